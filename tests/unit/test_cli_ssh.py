"""ringflow.runner.ssh and the command line's parsing (no process is started here)."""

from __future__ import annotations

import shlex

import pytest

from ringflow.errors import ConfigError, LaunchError
from ringflow.runner import cli
from ringflow.runner.launch import MEMCPY_TUNABLE, glibc_tunables
from ringflow.runner.ssh import SshOptions, remote_environ, ssh_argv

pytestmark = pytest.mark.timeout(60)

ENV = {
    "PATH": "/usr/bin", "RINGFLOW_RANK": "3", "RINGFLOW_SECRET_FD": "7",
    "RINGFLOW_LAUNCHER_PID": "1", "AWS_SECRET_ACCESS_KEY": "hunter2", "LC_ALL": "C",
    "NCCL_DEBUG": "INFO", "MY_VAR": "x y",
}


def test_remote_environment_is_an_allow_list():
    assert remote_environ(ENV) == {
        "PATH": "/usr/bin", "RINGFLOW_RANK": "3", "LC_ALL": "C", "NCCL_DEBUG": "INFO"
    }
    assert remote_environ(ENV, ["MY_VAR"])["MY_VAR"] == "x y"


def test_workers_get_the_memcpy_tunable_unless_the_user_set_it():
    assert glibc_tunables({}) == MEMCPY_TUNABLE
    assert glibc_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == \
        f"glibc.malloc.arena_max=2:{MEMCPY_TUNABLE}"
    mine = "glibc.cpu.x86_non_temporal_threshold=0x800000"
    assert glibc_tunables({"GLIBC_TUNABLES": mine}) == mine
    assert remote_environ({"GLIBC_TUNABLES": mine}) == {"GLIBC_TUNABLES": mine}


def test_ssh_argv_quotes_everything_and_keeps_host_key_checking():
    opts = SshOptions(port=2222, identity_file="/k/id rsa", cwd="/work dir/$HOME",
                      python="/py", export=("MY_VAR",), bind_interface="eth0")
    argv = ssh_argv("node1", ["python", "train.py", "--name", "a b; rm -rf /"], ENV, opts)
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k/id rsa"
    assert "StrictHostKeyChecking=no" not in argv
    assert argv[-3:-1] == ["node1", "--"]
    words = shlex.split(argv[-1])  # what the remote shell sees
    assert words[:4] == ["cd", "/work dir/$HOME", "&&", "exec"]
    assert words[words.index("--", 6) + 1:] == ["python", "train.py", "--name", "a b; rm -rf /"]
    assert "MY_VAR=x y" in words and "RINGFLOW_RANK=3" in words
    assert not any("SECRET" in w or "hunter2" in w for w in words)
    assert words[words.index("--bind-interface"):][:2] == ["--bind-interface", "eth0"]


def test_host_key_checking_is_off_only_when_asked():
    argv = ssh_argv("n", ["true"], {}, SshOptions(host_key_checking=False))
    assert "StrictHostKeyChecking=no" in argv


@pytest.mark.parametrize("host", ["-oProxyCommand=x", ""])
def test_hosts_that_look_like_options_are_refused(host):
    with pytest.raises(LaunchError, match="not a valid host name"):
        ssh_argv(host, ["true"], {}, SshOptions())


def parse(*argv: str):
    return cli._parse(list(argv))


def test_tuning_flags_become_worker_variables():
    args = parse("-np", "2", "--fusion-threshold-mb", "1.5", "--cycle-time-ms", "2",
                 "--cache-capacity", "0", "--timeline-filename", "/t/tl.json",
                 "--stall-check-warning-time-seconds", "5",
                 "--stall-check-shutdown-time-seconds", "9", "--log-level", "TRACE",
                 "--start-timeout", "12", "python", "x.py")
    assert cli.worker_overrides(args) == {
        "RINGFLOW_FUSION_THRESHOLD_BYTES": str(int(1.5 * 1024 * 1024)),
        "RINGFLOW_CYCLE_TIME_MS": "2.0", "RINGFLOW_CACHE_CAPACITY": "0",
        "RINGFLOW_TIMELINE_PATH": "/t/tl.json", "RINGFLOW_STALL_WARNING_S": "5.0",
        "RINGFLOW_STALL_SHUTDOWN_S": "9.0", "RINGFLOW_LOG_LEVEL": "debug",
        "RINGFLOW_TIMEOUT_S": "12.0",
    }
    assert args.command == ["python", "x.py"]
    assert cli.worker_overrides(parse("-np", "2", "x")) == {}
    off = cli.worker_overrides(parse("-np", "2", "--no-stall-check", "x"))
    assert off == {"RINGFLOW_STALL_WARNING_S": "0", "RINGFLOW_STALL_SHUTDOWN_S": "0",
                   "RINGFLOW_DEADLOCK_SHUTDOWN_S": "0"}


def test_config_file_keys_are_long_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("fusion-threshold-mb: 2\ncycle_time_ms: 4\nhosts: a:2,b:2\n"
                    "prefix-timestamp: true\nexport: [A, B]\n")
    args = parse("-np", "4", "--config-file", str(path), "--cycle-time-ms", "7", "x")
    assert (args.fusion_threshold_mb, args.cycle_time_ms, args.hosts) == (2.0, 7.0, "a:2,b:2")
    assert args.prefix_timestamp is True and args.export == ["A", "B"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("fusion-treshold-mb: 2\n", "unknown key 'fusion-treshold-mb'; did you mean "
                                    "'fusion-threshold-mb'"),
        ("cycle-time-ms: fast\n", "'fast' is not a valid value for --cycle-time-ms"),
        ("no-stall-check: maybe\n", "'maybe' is not true or false"),
        ("log-level: loud\n", "is not one of"),
        ("- a\n- b\n", "expected a mapping"),
    ],
)
def test_config_file_errors(tmp_path, capsys, text, fragment):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert parse("-np", "2", "--config-file", str(path), "x") == cli.USAGE_ERROR
    assert fragment in capsys.readouterr().err


def test_usage_errors_before_anything_starts(capsys, tmp_path):
    assert cli.main(["-np", "2", "--cycle-time-ms", "0", "true"]) == cli.USAGE_ERROR
    assert "RINGFLOW_CYCLE_TIME_MS=0.0 is out of range" in capsys.readouterr().err
    assert cli.main(["-np", "3", "-H", "a:1,b:1", "true"]) == cli.USAGE_ERROR
    assert "-np 3 asks for more processes than the 2 slots" in capsys.readouterr().err
    assert cli.main(["-np", "0", "true"]) == cli.USAGE_ERROR
    assert cli.main(["true"]) == cli.USAGE_ERROR  # -np missing
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=two\n")
    assert cli.main(["-np", "2", "--hostfile", str(hostfile), "true"]) == cli.USAGE_ERROR
    assert "line 2 ('b slots=two')" in capsys.readouterr().err
    assert cli.main(["-np", "2", "-H", "a:1", "--hostfile", str(hostfile), "true"]) == 2
    with pytest.raises(ConfigError):
        cli._load_config_file(cli._parser(), str(tmp_path / "missing.yaml"))
