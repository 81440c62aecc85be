"""The worker environment of ringflow.runner.launch: torchrun's variables and MASTER_PORT."""

from __future__ import annotations

import socket

import pytest

from ringflow.runner.hosts import assign_ranks, parse_hosts
from ringflow.runner.launch import HOROVOD_ENV, TORCHRUN_ENV, reserve_port, worker_environ
from ringflow.runner.ssh import SshOptions, remote_environ, ssh_argv

pytestmark = pytest.mark.timeout(60)


def environ(spec, **kwargs):
    return worker_environ(spec, rendezvous_addr="10.0.0.1", rendezvous_port=5, job_id="j",
                          base_env={"PATH": "/bin", "MASTER_PORT": "1", "RANK": "9"}, **kwargs)


def test_every_worker_gets_torchruns_variables():
    specs = assign_ranks(parse_hosts("a:2,b:2"), 3)  # a non-full last host
    envs = [environ(s, master_addr="a", master_port=29500) for s in specs]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"],
             e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "3", "2", "0", "2"), ("1", "1", "3", "2", "0", "2"),
        ("2", "0", "3", "1", "1", "2"),
    ]
    for rank, env in enumerate(envs):
        assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["ROLE_NAME"]) == (
            str(rank), "3", "default")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("a", "29500")
        assert env["RINGFLOW_RANK"] == env["RANK"]  # ringflow's own contract is unchanged
        assert set(TORCHRUN_ENV) <= set(env)
        # horovodrun's, which scripts (and Horovod's own tests) read
        assert [env[f"HOROVOD_{k}"] for k in ("RANK", "SIZE", "LOCAL_RANK", "CROSS_RANK")] == [
            env["RINGFLOW_RANK"], "3", env["LOCAL_RANK"], env["GROUP_RANK"]]


def test_a_stale_master_of_the_launchers_environment_is_dropped():
    (spec,) = assign_ranks(parse_hosts("localhost:1"), 1)
    env = environ(spec)
    assert "MASTER_PORT" not in env and "MASTER_ADDR" not in env
    assert env["RANK"] == "0"


def test_remote_workers_get_torchruns_variables_and_x_assignments():
    specs = assign_ranks(parse_hosts("a:1,b:1"), 2)
    env = {**environ(specs[1], master_addr="a", master_port=7), "FOO": "x y", "SECRET": "no"}
    forwarded = remote_environ(env, ["FOO"])
    for name in (*TORCHRUN_ENV, *HOROVOD_ENV):
        assert forwarded[name] == env[name]
    assert forwarded["FOO"] == "x y" and "SECRET" not in forwarded
    argv = ssh_argv("b", ["python", "t.py"], env, SshOptions(export=("FOO",), python="/py"))
    assert "'FOO=x y'" in argv[-1] and "MASTER_PORT=7" in argv[-1]


def test_the_reserved_port_is_not_handed_out_but_a_reusing_listener_may_take_it():
    reserved = reserve_port()
    try:
        port = reserved.getsockname()[1]
        others = []
        for _ in range(50):  # no bind to port 0 gets it while it is reserved
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            others.append(s)
        assert port not in {s.getsockname()[1] for s in others}
        for s in others:
            s.close()
        # What torch's TCPStore on rank 0 does: SO_REUSEADDR, bind, listen.
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        reserved.close()
