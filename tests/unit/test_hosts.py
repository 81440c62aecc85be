"""ringflow.runner.hosts: -H parsing and host-by-host rank assignment."""

from __future__ import annotations

import pytest

from ringflow.errors import LaunchError
from ringflow.runner.hosts import (
    Host,
    WorkerSpec,
    assign_ranks,
    is_local,
    parse_hostfile,
    parse_hosts,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("localhost:4", [Host("localhost", 4)]),
        ("a:2,b:1", [Host("a", 2), Host("b", 1)]),
        ("a, b:3", [Host("a", 1), Host("b", 3)]),
        ("[::1]:2,10.0.0.2:1", [Host("::1", 2), Host("10.0.0.2", 1)]),
    ],
)
def test_parse(spec, hosts):
    assert parse_hosts(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("a:0", "has slots '0'; expected a positive integer"),
        ("a:-2", "has slots '-2'"),
        ("a:x", "has slots 'x'"),
        ("a:", "has slots ''"),
        ("a:2,,b:1", "host entry '' in -H"),
        (":2", "host entry ':2'"),
        ("a:1:2", "host entry 'a:1:2'"),
        ("a:1,a:2", "host 'a' appears twice"),
    ],
)
def test_parse_errors(spec, fragment):
    with pytest.raises(LaunchError, match=fragment):
        parse_hosts(spec)


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_single_host_assignment(np):
    specs = assign_ranks([Host("localhost", 4)], np)
    assert specs == [WorkerSpec(r, np, r, np, 0, 1, "localhost") for r in range(np)]


def test_host_by_host_assignment_drops_unused_hosts():
    specs = assign_ranks(parse_hosts("a:2,b:2,c:4"), 3)
    assert [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in specs] == [
        (0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2), (2, "b", 0, 1, 1, 2),
    ]
    assert all(s.size == 3 for s in specs)


def test_more_ranks_than_slots_is_an_error():
    with pytest.raises(LaunchError, match="-np 5 asks for more processes than the 4 slots"):
        assign_ranks(parse_hosts("a:2,b:2"), 5)


@pytest.mark.parametrize("np", [0, -1])
def test_np_must_be_positive(np):
    with pytest.raises(LaunchError, match="expected -np >= 1"):
        assign_ranks([Host("localhost", 2)], np)


def test_is_local():
    assert is_local("localhost")
    assert is_local("127.0.0.1")
    assert not is_local("no-such-host.invalid")


# --hostfile ----------------------------------------------------------------------------------


def write(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_forms_comments_and_blank_lines(tmp_path):
    text = "# the cluster\nnode1 slots=2\n\n  node2:3   # three GPUs\nnode3\n[::1] slots = 4\n"
    assert parse_hostfile(write(tmp_path, text)) == [
        Host("node1", 2), Host("node2", 3), Host("node3", 1), Host("::1", 4)
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("node1 slots=2\nnode2 slots=x\n", "line 2 ('node2 slots=x')"),
        ("node1 slots=2\nnode2 max_slots=4\n", "line 2 ('node2 max_slots=4') is not valid"),
        ("node1 slots=0\n", "expected a positive integer"),
        ("a:2 slots=3\n", "line 1 ('a:2 slots=3') is not valid"),
        ("node1\n# x\nnode1 slots=2\n", "line 3 ('node1 slots=2') names host 'node1' a second"),
        ("# only a comment\n\n", "lists no host"),
    ],
)
def test_hostfile_errors_name_the_line(tmp_path, text, fragment):
    with pytest.raises(LaunchError) as info:
        parse_hostfile(write(tmp_path, text))
    assert fragment in str(info.value)
    assert "hostfile" in str(info.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(LaunchError, match="cannot read --hostfile"):
        parse_hostfile(str(tmp_path / "nope"))
