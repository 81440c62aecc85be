"""ringflow-run's horovodrun / torchrun / mpirun spellings: parsing and the workers' environment.

No process is started: ``run_job`` is replaced by a recorder.
"""

from __future__ import annotations

import os
import sys

import pytest

from ringflow.runner import cli, dialects
from ringflow.runner.launch import JobResult

pytestmark = pytest.mark.timeout(60)


def parse(*argv: str):
    return cli._parse(list(argv))


def usage(capsys, *argv: str) -> list[str]:
    """The stderr lines of a usage error (which must be exit code 2)."""
    assert cli._parse(list(argv)) == cli.USAGE_ERROR
    return capsys.readouterr().err.splitlines()


@pytest.fixture
def job(monkeypatch):
    """Run cli.main without starting anything; returns the recorded run_job call."""
    calls: dict = {}

    def fake_run_job(command, workers, **kwargs):
        calls.update(kwargs, command=command, workers=workers)
        return JobResult(0, ())

    monkeypatch.setattr(cli, "run_job", fake_run_job)
    for name in list(os.environ):
        if name.startswith(("RINGFLOW_", "HOROVOD_")):
            monkeypatch.delenv(name)
    return calls


# --- mapped spellings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--num-proc", "3"], "np", 3),
        (["-np", "3"], "np", 3),
        (["-hostfile", "h.txt"], "hostfile", "h.txt"),
        (["-machinefile", "h.txt"], "hostfile", "h.txt"),
        (["--machinefile", "h.txt"], "hostfile", "h.txt"),
        (["-prefix-timestamp"], "prefix_timestamp", True),
        (["--prefix-output-with-timestamp"], "prefix_timestamp", True),
        (["--timestamp-output"], "prefix_timestamp", True),
        (["--master-addr", "node1"], "master_addr", "node1"),
        (["--master_addr", "node1"], "master_addr", "node1"),
        (["--master-port", "29500"], "master_port", 29500),
        (["--master_port", "29500"], "master_port", 29500),
        (["--log-dir", "/logs"], "output_filename", "/logs"),
        (["--log_dir", "/logs"], "output_filename", "/logs"),
        (["--nnodes", "1"], "np", 2),
        (["--nnodes", "1:1"], "np", 2),
        (["--node-rank", "0"], "np", 2),
        (["--node_rank", "0"], "np", 2),
        (["--standalone"], "standalone", True),
        (["--max-restarts", "0"], "max_restarts", 0),
        (["--max_restarts", "0"], "max_restarts", 0),
    ],
)
def test_mapped_spellings(argv, dest, value):
    args = parse(*argv, *([] if "-np" in argv or "--num-proc" in argv else ["-np", "2"]),
                 "true")
    assert getattr(args, dest) == value
    assert args.notes == []


def test_check_build_short_spelling():
    args = parse("-cb")
    assert args.check_build is True


@pytest.mark.parametrize(
    ("argv", "transport"),
    [
        ([], None),
        (["--gloo"], "auto"),
        (["--tcp"], "tcp"),
        (["--gloo", "--tcp"], "tcp"),
        (["--transport", "shm"], "shm"),
        (["--transport", "tcp", "--tcp"], "tcp"),
        (["--gloo", "--transport", "shm"], "shm"),
    ],
)
def test_transport_flags(argv, transport):
    env = cli.worker_overrides(parse("-np", "2", *argv, "true"))
    assert env.get("RINGFLOW_TRANSPORT") == transport


def test_tcp_and_another_transport_disagree(capsys):
    assert usage(capsys, "-np", "2", "--tcp", "--transport", "shm", "true") == [
        "ringflow-run: --tcp: --transport shm says otherwise"
    ]


@pytest.mark.parametrize("argv", [["--mpi"], ["--transport", "mpi"]])
def test_mpi_needs_mpirun_and_the_message_gives_the_command(capsys, argv):
    lines = usage(capsys, "-np", "4", "-H", "a:2,b:2", *argv, "python", "train.py", "--lr", "1")
    assert len(lines) == 1
    assert lines[0].startswith(f"ringflow-run: {' '.join(argv)}: workers started by "
                               "ringflow-run are not an MPI job")
    assert "run `mpirun -np 4 -H a:2,b:2 python train.py --lr 1` instead" in lines[0]


def test_stall_check_undoes_no_stall_check():
    off = cli.worker_overrides(parse("-np", "2", "--no-stall-check", "--stall-check", "x"))
    assert "RINGFLOW_STALL_WARNING_S" not in off


def test_gloo_timeout_is_the_workers_timeout_and_wins_over_start_timeout():
    env = cli.worker_overrides(parse("-np", "2", "--gloo-timeout-seconds", "45", "x"))
    assert env["RINGFLOW_TIMEOUT_S"] == "45.0"
    both = parse("-np", "2", "--start-timeout", "10", "--gloo-timeout-seconds", "45", "x")
    assert cli.worker_overrides(both)["RINGFLOW_TIMEOUT_S"] == "45.0"
    assert both.start_timeout == 10.0  # still the launcher's own wait


# --- torchrun -----------------------------------------------------------------------------------


def test_nproc_per_node_is_np_on_this_host(monkeypatch):
    assert parse("--nproc-per-node", "3", "true").np == 3
    assert parse("--nproc_per_node", "3", "-np", "3", "true").np == 3
    monkeypatch.setattr("ringflow.runner.check_build._gpus", lambda: [])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert parse("--nproc-per-node", "cpu", "true").np == cpus
    assert parse("--nproc-per-node", "auto", "true").np == cpus
    monkeypatch.setattr("ringflow.runner.check_build._gpus", lambda: ["GPU 0", "GPU 1"])
    assert parse("--nproc-per-node", "gpu", "true").np == 2
    assert parse("--nproc-per-node", "auto", "true").np == 2


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0: expected a number >= 1, cpu, gpu or auto"),
        (["--nproc-per-node", "many"], "--nproc-per-node many: expected a number >= 1"),
        (["--nproc-per-node", "2", "-np", "4"], "--nproc-per-node 2: -np 4 says otherwise"),
        (["--nproc-per-node", "2", "-H", "a:2,b:2"],
         "--nproc-per-node 2: it gives the ranks of this host only; with -H / --hostfile give "
         "each host's slots there (host:N) and the total with -np"),
        (["--nproc-per-node", "gpu"], "--nproc-per-node gpu: nvidia-smi lists no GPU"),
        (["--nnodes", "2", "-np", "2"], "--nnodes 2: ringflow-run starts the whole job from one "
                                        "host: list every host with -H node1:N,node2:N"),
        (["--nnodes", "1:4", "-np", "2"], "--nnodes 1:4: ringflow-run starts the whole job"),
        (["--node-rank", "1", "-np", "2"], "--node-rank 1: ringflow-run starts the whole job"),
        (["--max-restarts", "3", "-np", "2"],
         "--max-restarts 3: ringflow jobs are not restarted: the first failing rank ends the job"),
        (["--log-dir", "a", "--output-filename", "b", "-np", "2"],
         "--log-dir a: --output-filename b says otherwise"),
        (["-m", "--no-python", "-np", "2"], "-m: --module runs `python -m COMMAND`"),
    ],
)
def test_torchrun_values_ringflow_cannot_honour(capsys, monkeypatch, argv, line):
    monkeypatch.setattr("ringflow.runner.check_build._gpus", lambda: [])
    lines = usage(capsys, *argv, "x.py")
    assert len(lines) == 1
    assert lines[0].startswith(f"ringflow-run: {line}")


def test_python_commands_as_torchrun_runs_them(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    assert parse("-np", "2", str(script), "--lr", "1").command == [
        sys.executable, str(script), "--lr", "1"]
    assert parse("-np", "2", "--no-python", str(script)).command == [str(script)]
    assert parse("-np", "2", "-m", "pkg.train", "--lr", "1").command == [
        sys.executable, "-m", "pkg.train", "--lr", "1"]
    assert parse("-np", "2", "--module", "pkg.train").command[1:] == ["-m", "pkg.train"]
    assert parse("-np", "2", "--run-path", "train").command == [sys.executable, "train"]
    assert parse("-np", "2", "python", str(script)).command == ["python", str(script)]
    script.chmod(0o755)  # an executable script keeps its own interpreter (its #! line)
    assert parse("-np", "2", str(script)).command == [str(script)]


def test_master_address_and_port_reach_run_job(job):
    assert cli.main(["-np", "2", "--master-addr", "10.1.2.3", "--master-port", "29555",
                     "true"]) == 0
    assert (job["master_addr"], job["master_port"]) == ("10.1.2.3", 29555)
    assert cli.main(["-np", "2", "true"]) == 0
    assert (job["master_addr"], job["master_port"]) == (None, None)  # run_job picks them


def test_standalone_is_this_host_only(capsys, job):
    assert cli.main(["--standalone", "--nproc-per-node", "2", "true"]) == 0
    assert cli.main(["--standalone", "-np", "2", "-H", "localhost:1,node2:1", "true"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ringflow-run: --standalone: it runs on this host only, but the job uses localhost, "
        "node2; drop --standalone or -H"
    ]


def test_shared_memory_transport_needs_one_host(capsys, job):
    assert cli.main(["-np", "2", "-H", "localhost:1,node2:1", "--transport", "shm", "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ringflow-run: --transport shm: shared memory joins the ranks of one host, but the job "
        "spans 2 hosts; use --transport auto (shared memory within hosts, TCP across)"
    ]
    assert cli.main(["-np", "2", "--transport", "shm", "x"]) == 0
    assert job["base_env"]["RINGFLOW_TRANSPORT"] == "shm"


# --- notes and refusals -------------------------------------------------------------------------


def _args_for(entry: dialects.Foreign, flag: str) -> list[str]:
    return [flag, *(["7"] * entry.nargs)]


@pytest.mark.parametrize(
    ("entry", "flag"),
    [(e, f) for e in dialects.NOTES for f in e.flags],
    ids=[f for e in dialects.NOTES for f in e.flags],
)
def test_each_accepted_flag_runs_with_a_note_or_silently(job, capsys, entry, flag):
    assert cli.main([*_args_for(entry, flag), "-np", "2", "true"]) == 0
    err = capsys.readouterr().err.splitlines()
    if entry.on:
        assert err == [f"ringflow-run: note: {flag}: {entry.text}"]
    else:
        assert err == []  # asks for what ringflow does anyway
    assert job["command"] == ["true"]


@pytest.mark.parametrize(
    ("entry", "flag"),
    [(e, f) for e in dialects.REFUSED if e.text for f in e.flags],
    ids=[f for e in dialects.REFUSED if e.text for f in e.flags],
)
def test_each_refused_flag_is_one_line_and_exit_2(capsys, entry, flag):
    assert usage(capsys, *_args_for(entry, flag), "-np", "2", "true") == [
        f"ringflow-run: {flag}: {entry.text}"
    ]


def test_refusal_texts():
    texts = {f: e.text for e in dialects.REFUSED for f in e.flags}
    assert "ringflow-run runs the job's rendezvous itself" in texts["--rdzv-endpoint"]
    assert texts["--rdzv_backend"] == texts["--rdzv-endpoint"]
    assert "use --network-interface IF" in texts["--local-addr"]
    assert "run `mpirun ARGS python train.py` yourself" in texts["--mpi-args"]
    assert "--bind-to core pins each rank" in texts["--binding-args"]
    assert "does not start jsrun" in texts["--jsrun"]
    assert "MCA parameters configure Open MPI" in texts["-mca"]
    assert "never oversubscribes" in texts["--oversubscribe"]
    assert "host by host" in texts["--map-by"]


def test_notes_that_share_a_text_are_one_line(job, capsys):
    assert cli.main(["-np", "2", "--autotune-bayes-opt-max-samples", "9",
                     "--autotune-gaussian-process-noise", "0.5", "--hierarchical-allreduce",
                     "true"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "ringflow-run: note: --hierarchical-allreduce: ringflow picks the hierarchical allreduce "
        "itself (shared memory within each host, a ring across hosts) whenever every host runs "
        "the same number of ranks; --transport tcp gives a flat ring",
        "ringflow-run: note: --autotune-bayes-opt-max-samples, --autotune-gaussian-process-noise:"
        " ringflow's autotuner is a coordinate search, not Bayesian optimisation; "
        "--autotune-steps-per-sample sets its sample length",
    ]


def test_horovods_autotune_flags_run_ringflows_autotuner(job, capsys):
    assert cli.main(["-np", "2", "--autotune", "--autotune-log-file", "a.csv",
                     "--autotune-warmup-samples", "3", "--autotune-steps-per-sample", "4",
                     "--autotune-compression", "fp16", "true"]) == 0
    env = job["base_env"]
    assert env["RINGFLOW_AUTOTUNE"] == "1"
    assert env["RINGFLOW_AUTOTUNE_LOG_FILE"] == os.path.abspath("a.csv")
    assert (env["RINGFLOW_AUTOTUNE_WARMUP_SAMPLES"], env["RINGFLOW_AUTOTUNE_STEPS_PER_SAMPLE"],
            env["RINGFLOW_AUTOTUNE_COMPRESSION"]) == ("3", "4", "fp16")
    assert capsys.readouterr().err == ""


def test_every_refusal_is_reported_not_only_the_first(capsys):
    assert usage(capsys, "--rdzv-id", "1", "--oversubscribe", "-np", "2", "true") == [
        "ringflow-run: --rdzv-id: ringflow-run runs the job's rendezvous itself (an "
        "authenticated store on a free port); for several hosts list them with -H "
        "node1:N,node2:N",
        "ringflow-run: --oversubscribe: ringflow-run never oversubscribes: -np must fit in the "
        "slots of -H host:N; raise the slots",
    ]


@pytest.mark.parametrize(
    ("flag", "line"),
    [
        ("--fusion-treshold-mb", "--fusion-treshold-mb: unknown flag; did you mean "
                                 "--fusion-threshold-mb?"),
        ("--nproc_per_nod", "--nproc_per_nod: unknown flag; did you mean --nproc_per_node?"),
        ("--elastic-timout", "--elastic-timout: unknown flag; did you mean --elastic-timeout?"),
        # allow_abbrev=False: a prefix is not the flag it starts
        ("--fusion-threshold", "--fusion-threshold: unknown flag; did you mean "
                               "--fusion-threshold-mb?"),
        ("--zzz", "--zzz: unknown flag; see ringflow-run --help"),
    ],
)
def test_unknown_flags_get_a_did_you_mean(capsys, flag, line):
    assert usage(capsys, f"{flag}=2", "-np", "2", "true") == [f"ringflow-run: {line}"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["-np", "x", "true"], "error: argument -np/--num-proc: invalid int value: 'x'"),
        (["-np", "2", "--bind-to", "socket", "true"],
         "error: argument --bind-to: invalid choice: 'socket' "
         "(choose from 'none', 'core', 'auto')"),
        (["true"], "error: the following arguments are required: -np; e.g. ringflow-run -np 2 "
                   "python train.py"),
        (["-np", "2"], "error: no command given; e.g. ringflow-run -np 2 python train.py"),
        (["-np", "2", "--min-np"], "error: argument --min-np/--min-num-proc: expected one "
                                   "argument"),
        (["-np", "2", "--min-np", "2", "true"], "error: --min-np is for elastic jobs: add "
                                                "--host-discovery-script SCRIPT"),
        (["--host-discovery-script", "x", "--min-np", "3", "--max-np", "2", "true"],
         "error: --min-np 3 is above --max-np 2"),
        (["--host-discovery-script", "x", "-H", "a:2", "true"],
         "error: an elastic job takes its hosts from --host-discovery-script; drop -H / "
         "--hostfile"),
        (["--host-discovery-script", "x", "--blacklist-cooldown-range", "5", "1", "true"],
         "error: --blacklist-cooldown-range 5 1: give 0 <= LO <= HI"),
        (["--host-discovery-script", "x"], "error: no command given; e.g. ringflow-run "
                                          "--min-np 2 --host-discovery-script ./hosts.sh python "
                                          "train.py"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, line):
    assert usage(capsys, *argv) == [f"ringflow-run: {line}"]


def test_help_and_docs_list_every_foreign_spelling(capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["--help"])
    text = capsys.readouterr().out
    flags = [f for e in (*dialects.NOTES, *dialects.REFUSED) for f in e.flags]
    for spelling, _ in dialects.MAPPED:
        assert spelling in text
        flags += [w.rstrip(",") for w in spelling.split() if w.startswith("-")]
    for flag in flags:
        assert flag in text, flag
        if "_" not in flag and "|" not in flag:
            assert f"``{flag}" in cli.__doc__, flag
    parser = cli._parser()
    for flag in flags:  # and every one of them is a flag the parser knows
        assert flag.split("|")[0] in parser._option_string_actions or flag == "-x", flag


# --- -x -----------------------------------------------------------------------------------------


def test_x_name_value_sets_it_for_every_worker_and_x_name_forwards(job, monkeypatch):
    monkeypatch.setenv("MINE", "launcher")
    monkeypatch.setenv("KEPT", "as is")
    assert cli.main(["-np", "2", "-x", "FOO=a=b c", "-x", "MINE=worker", "-x", "KEPT",
                     "-x", "EMPTY=", "true"]) == 0
    env = job["base_env"]
    assert (env["FOO"], env["MINE"], env["KEPT"], env["EMPTY"]) == (
        "a=b c", "worker", "as is", "")
    assert job["ssh"].export == ("FOO", "MINE", "KEPT", "EMPTY")  # all reach ssh workers


def test_x_cannot_set_what_the_launcher_sets(capsys):
    assert usage(capsys, "-np", "2", "-x", "RANK=3", "-x", "RINGFLOW_SIZE", "-x",
                 "MASTER_ADDR=h", "-x", "1A", "true") == [
        "ringflow-run: -x RANK=3: ringflow-run sets RANK for every worker (from -np and the "
        "hosts); it cannot be exported",
    ]
    assert usage(capsys, "-np", "2", "-x", "MASTER_ADDR=h", "true") == [
        "ringflow-run: -x MASTER_ADDR=h: ringflow-run sets MASTER_ADDR for every worker; use "
        "--master-addr h"
    ]
    assert usage(capsys, "-np", "2", "-x", "1A", "true") == [
        "ringflow-run: -x 1A: '1A' is not an environment variable name; expected -x NAME or "
        "-x NAME=VALUE"
    ]


def test_flags_win_over_x_assignments(job):
    assert cli.main(["-np", "2", "-x", "RINGFLOW_CYCLE_TIME_MS=9", "--cycle-time-ms", "3",
                     "true"]) == 0
    assert job["base_env"]["RINGFLOW_CYCLE_TIME_MS"] == "3.0"


# --- HOROVOD_* in the launcher's environment ----------------------------------------------------


def test_horovod_variables_become_the_workers_ringflow_variables(job, capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    assert cli.main(["-np", "2", "--cycle-time-ms", "2", "true"]) == 0
    env = job["base_env"]
    assert env["RINGFLOW_FUSION_THRESHOLD_BYTES"] == "1048576"
    assert env["RINGFLOW_CYCLE_TIME_MS"] == "2.0"  # the flag wins
    assert env["HOROVOD_CYCLE_TIME"] == "5"  # the user's variables are left alone
    assert capsys.readouterr().err.splitlines() == [
        "ringflow-run: warning: HOROVOD_FUSION_THRESHOLD=1048576 read as "
        "RINGFLOW_FUSION_THRESHOLD_BYTES=1048576",
        "ringflow-run: warning: HOROVOD_AUTOTUNE=1 read as RINGFLOW_AUTOTUNE=1",
        "ringflow-run: note: HOROVOD_CYCLE_TIME=5 is ignored: RINGFLOW_CYCLE_TIME_MS=2.0 is set",
    ]


def test_x_horovod_assignment_is_read_too(job, capsys):
    assert cli.main(["-np", "2", "-x", "HOROVOD_STALL_CHECK_DISABLE=1", "true"]) == 0
    env = job["base_env"]
    assert (env["RINGFLOW_STALL_WARNING_S"], env["RINGFLOW_STALL_SHUTDOWN_S"]) == ("0", "0")
    assert "HOROVOD_STALL_CHECK_DISABLE=1 read as" in capsys.readouterr().err


def test_bad_horovod_value_is_a_usage_error(job, capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "0")
    assert cli.main(["-np", "2", "true"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ringflow-run: error: HOROVOD_CYCLE_TIME='0' (read as RINGFLOW_CYCLE_TIME_MS=0.0) is out "
        "of range; the default is 1.0")
    assert "command" not in job


# --- horovodrun's nested --config-file ----------------------------------------------------------

NESTED = """\
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: false
  hierarchical_allgather: false
autotune:
  enabled: false
  log_file: tune.csv
timeline:
  filename: /tmp/tl.json
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 20
  shutdown_time_seconds: 100
library_options:
  mpi_threads_disable: false
  num_nccl_streams: 2
  gloo_timeout_seconds: 40
logging:
  level: TRACE
  with_timestamp: false
"""


def test_horovodruns_nested_config_file(tmp_path, job, capsys):
    path = tmp_path / "hvd.yaml"
    path.write_text(NESTED)
    assert cli.main(["-np", "2", "--config-file", str(path), "true"]) == 0
    env = job["base_env"]
    assert {k: env[k] for k in env if k.startswith("RINGFLOW_")} == {
        "RINGFLOW_TRANSPORT": "auto",
        "RINGFLOW_FUSION_THRESHOLD_BYTES": str(32 << 20),
        "RINGFLOW_CYCLE_TIME_MS": "10.0",
        "RINGFLOW_CACHE_CAPACITY": "2048",
        "RINGFLOW_TIMELINE_PATH": "/tmp/tl.json",
        "RINGFLOW_STALL_WARNING_S": "20.0",
        "RINGFLOW_STALL_SHUTDOWN_S": "100.0",
        "RINGFLOW_TIMEOUT_S": "40.0",
        "RINGFLOW_LOG_LEVEL": "debug",
        "RINGFLOW_BIND_TO": "auto",  # ringflow-run's default
        "RINGFLOW_AUTOTUNE": "0",
        "RINGFLOW_AUTOTUNE_LOG_FILE": os.path.abspath("tune.csv"),
    }
    key = "--config-file"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"ringflow-run: note: {key} params.hierarchical_allreduce: ringflow picks the "
        "hierarchical allreduce itself whenever every host runs the same number of ranks; "
        "--transport tcp gives a flat ring",
        f"ringflow-run: note: {key} timeline.mark_cycles: ringflow has no cycles to mark "
        "(negotiation is event-driven); the timeline is written without them",
        f"ringflow-run: note: {key} library_options.num_nccl_streams: ringflow takes no number "
        "of NCCL streams",
    ]


def test_nested_config_file_stall_check_off_and_the_command_line_wins(tmp_path):
    path = tmp_path / "hvd.yaml"
    path.write_text("stall_check:\n  enabled: false\nparams:\n  cycle_time_ms: 10\n")
    env = cli.worker_overrides(parse("-np", "2", "--config-file", str(path), "--cycle-time-ms",
                                     "3", "x"))
    assert env["RINGFLOW_CYCLE_TIME_MS"] == "3.0"
    assert env["RINGFLOW_STALL_SHUTDOWN_S"] == "0"
    path.write_text("fusion-threshold-mb: 2\nparams:\n  cache_capacity: 5\n")  # both forms
    env = cli.worker_overrides(parse("-np", "2", "--config-file", str(path), "x"))
    assert (env["RINGFLOW_FUSION_THRESHOLD_BYTES"], env["RINGFLOW_CACHE_CAPACITY"]) == (
        str(2 << 20), "5")


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("controller: mpi\n", "ringflow-run: --config-file controller: workers started by "
                               "ringflow-run are not an MPI job"),
        ("controller: jsrun\n", "controller: 'jsrun' is not gloo or mpi"),
        ("params:\n  fusion_treshold_mb: 2\n",
         "unknown key 'params.fusion_treshold_mb'; did you mean 'params.fusion_threshold_mb'?"),
        ("params:\n  cycle_time_ms: fast\n",
         "params.cycle_time_ms: 'fast' is not a valid value for --cycle-time-ms"),
        ("stall_check:\n  enabled: maybe\n", "stall_check.enabled: 'maybe' is not true or false"),
        ("logging:\n  level: loud\n", "logging.level: 'loud' is not one of"),
    ],
)
def test_nested_config_file_errors(tmp_path, capsys, text, line):
    path = tmp_path / "hvd.yaml"
    path.write_text(text)
    lines = usage(capsys, "-np", "2", "--config-file", str(path), "python", "t.py")
    assert len(lines) == 1
    assert line.format(path=path) in lines[0]
