"""Store semantics, the same for MemoryStore, FileStore and TCPStore; read_secret and connect."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator

import pytest

from ringflow import rendezvous
from ringflow.errors import ConfigError, PeerError, RingflowTimeoutError, ShutdownError
from ringflow.rendezvous import (
    FileStore,
    MemoryStore,
    Store,
    StoreServer,
    TCPStore,
    connect,
    read_secret,
)
from ringflow.wire import new_secret

pytestmark = pytest.mark.timeout(60)

SHORT = 0.05  # seconds: a timeout that is meant to expire


@pytest.fixture(params=["memory", "file", "tcp"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_store(kind: str, tmp_path) -> Iterator:
    """A factory of stores that share one data set (one server, one directory, one memory)."""
    made: list = []
    secret = new_secret()
    server = StoreServer(secret) if kind == "tcp" else None
    memory = MemoryStore(timeout=5.0)

    def make() -> Store:
        if kind == "memory":
            return memory
        if kind == "file":
            store: Store = FileStore(tmp_path / "store", timeout=5.0)
        else:
            store = TCPStore(server.host, server.port, secret, timeout=5.0)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
    memory.close()
    if server is not None:
        server.close()


@pytest.fixture
def store(make_store) -> Store:
    return make_store()


def test_is_a_store(store: Store) -> None:
    assert isinstance(store, Store)


def test_set_get_overwrite(store: Store) -> None:
    store.set("a", b"1")
    store.set("empty", b"")
    store.set("bin", bytes(range(256)))
    store.set("unicode/ключ", bytearray(b"x"))
    assert store.get("a") == b"1"
    assert store.get("empty") == b""
    assert store.get("bin") == bytes(range(256))
    assert store.get("unicode/ключ") == b"x"
    store.set("a", b"2")
    assert store.get("a") == b"2"


def test_long_key(store: Store) -> None:
    key = "k" * rendezvous.MAX_KEY_BYTES
    store.set(key, b"v")
    assert store.get(key) == b"v"
    with pytest.raises(ConfigError, match="limit"):
        store.set(key + "k", b"v")


def test_bad_arguments(store: Store) -> None:
    with pytest.raises(ConfigError, match="non-empty str"):
        store.set("", b"v")
    with pytest.raises(ConfigError, match="must be bytes"):
        store.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="list of keys"):
        store.wait("k")
    with pytest.raises(ConfigError, match="finite"):
        store.get("k", timeout=-1)


def test_get_timeout_names_key(store: Store) -> None:
    start = time.monotonic()
    with pytest.raises(RingflowTimeoutError, match=r"'missing-key'.*RINGFLOW_TIMEOUT_S"):
        store.get("missing-key", timeout=SHORT)
    assert time.monotonic() - start < 3.0


def test_get_waits_for_set(make_store) -> None:
    reader, writer = make_store(), make_store()
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late", timeout=10)))
    thread.start()
    time.sleep(0.05)
    assert not got
    writer.set("late", b"here")
    thread.join(5)
    assert got == [b"here"]


def test_set_wakes_waiter_promptly(make_store) -> None:
    reader, writer = make_store(), make_store()
    woke: list[float] = []
    ready = threading.Event()

    def wait() -> None:
        ready.set()
        reader.wait(["prompt"], timeout=10)
        woke.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    ready.wait()
    time.sleep(0.05)
    set_at = time.monotonic()
    writer.set("prompt", b"")
    thread.join(5)
    # Promptness is a few ms; the bound is loose because this machine is shared.
    assert woke and woke[0] - set_at < 0.5


def test_wait(store: Store) -> None:
    store.wait([], timeout=SHORT)
    store.set("x", b"1")
    store.set("y", b"2")
    store.wait(["x", "y"], timeout=SHORT)
    with pytest.raises(RingflowTimeoutError) as info:
        store.wait(["x", "gone1", "y", "gone2"], timeout=SHORT)
    message = str(info.value)
    assert "2 of 4" in message and "'gone1'" in message and "'gone2'" in message
    assert "'x'" not in message


def test_add(store: Store) -> None:
    assert store.add("n", 1) == 1
    assert store.add("n", 5) == 6
    assert store.add("n", -10) == -4
    assert store.add("n", 0) == -4
    assert store.get("n") == b"-4"
    store.set("m", b"41")
    assert store.add("m", 1) == 42


def test_add_on_non_integer(store: Store) -> None:
    store.set("text", b"abc")
    with pytest.raises(ConfigError, match=r"'text'.*not an integer counter"):
        store.add("text", 1)
    assert store.get("text") == b"abc"  # unchanged, and a TCPStore still works
    with pytest.raises(ConfigError, match="64-bit"):
        store.add("big", 2**63)


def test_delete(store: Store) -> None:
    store.set("d", b"1")
    assert store.delete("d") is True
    assert store.delete("d") is False
    with pytest.raises(RingflowTimeoutError, match="'d'"):
        store.get("d", timeout=SHORT)


def test_closed_store_raises(kind: str, make_store) -> None:
    store = make_store()
    store.close()
    store.close()
    expected = PeerError if kind == "tcp" else ShutdownError
    with pytest.raises(expected, match="closed"):
        store.set("k", b"v")


def test_close_wakes_waiter() -> None:
    store = MemoryStore()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.get("never", timeout=30)
        except ShutdownError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    store.close()
    thread.join(5)
    assert len(errors) == 1


def test_add_atomic_threads(make_store) -> None:
    threads, adds = 6, 40
    stores = [make_store() for _ in range(threads)]

    def work(s: Store) -> None:
        for _ in range(adds):
            s.add("counter", 1)

    pool = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in pool:
        t.start()
    for t in pool:
        t.join(30)
    assert stores[0].get("counter") == str(threads * adds).encode()


def test_tcp_store_shared_between_threads() -> None:
    secret = new_secret()
    with StoreServer(secret) as server, TCPStore(server.host, server.port, secret) as client:
        results: list[int] = []
        lock = threading.Lock()

        def work() -> None:
            for _ in range(25):
                value = client.add("c", 1)
                with lock:
                    results.append(value)

        pool = [threading.Thread(target=work) for _ in range(4)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(30)
        assert sorted(results) == list(range(1, 101))


def _add_in_process(path: str, adds: int) -> None:
    store = FileStore(path)
    for _ in range(adds):
        store.add("counter", 1)


def test_file_store_add_atomic_across_processes(tmp_path) -> None:
    path, procs, adds = str(tmp_path / "store"), 3, 30
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_add_in_process, args=(path, adds)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(45)
    assert [w.exitcode for w in workers] == [0] * procs
    assert FileStore(path).get("counter") == str(procs * adds).encode()


def test_file_store_directory_is_private(tmp_path) -> None:
    FileStore(tmp_path / "private")
    if os.name == "posix":
        assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700


def test_file_store_is_atomic_for_readers(tmp_path) -> None:
    writer, reader = FileStore(tmp_path / "s"), FileStore(tmp_path / "s")
    values = [b"a" * 100_000, b"b" * 100_000]
    writer.set("v", values[0])
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            writer.set("v", values[i % 2])
            i += 1

    thread = threading.Thread(target=write)
    thread.start()
    try:
        for _ in range(200):
            assert reader.get("v") in values
    finally:
        stop.set()
        thread.join(5)
    assert not [p for p in os.listdir(tmp_path / "s") if p.startswith(".tmp-")]


def test_tcp_store_connect_refused() -> None:
    secret = new_secret()
    server = StoreServer(secret)
    port = server.port
    server.close()
    with pytest.raises(PeerError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, secret, timeout=0.2)


def test_tcp_store_after_server_close() -> None:
    secret = new_secret()
    server = StoreServer(secret)
    client = TCPStore(server.host, server.port, secret)
    server.close()
    with pytest.raises(PeerError, match="did not answer"):
        client.set("k", b"v")
    with pytest.raises(PeerError, match="closed"):
        client.get("k")


def test_server_close_releases_waiting_client() -> None:
    secret = new_secret()
    server = StoreServer(secret)
    client = TCPStore(server.host, server.port, secret, timeout=20)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.get("never", timeout=20)
        except (ShutdownError, PeerError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    server.close()
    thread.join(5)
    assert errors and time.monotonic() - start < 5


# -- read_secret and connect -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_secret_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous.secret, "_SECRETS", {})


def test_read_secret_from_fd() -> None:
    secret = new_secret()
    r, w = os.pipe()
    os.write(w, secret.hex().encode() + b"\n")
    os.close(w)
    env = {"RINGFLOW_SECRET_FD": str(r)}
    assert read_secret(env) == secret
    assert read_secret(env) == secret  # cached: the descriptor is closed after the first read
    with pytest.raises(OSError):
        os.fstat(r)


def test_read_secret_from_file(tmp_path) -> None:
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret.hex())
    path.chmod(0o600)
    assert read_secret({"RINGFLOW_SECRET_FILE": str(path)}) == secret


def test_read_secret_fd_wins(tmp_path) -> None:
    fd_secret, file_secret = new_secret(), new_secret()
    path = tmp_path / "secret"
    path.write_text(file_secret.hex())
    r, w = os.pipe()
    os.write(w, fd_secret.hex().encode())
    os.close(w)
    env = {"RINGFLOW_SECRET_FD": str(r), "RINGFLOW_SECRET_FILE": str(path)}
    assert read_secret(env) == fd_secret


def test_read_secret_missing() -> None:
    with pytest.raises(ConfigError, match=r"RINGFLOW_SECRET_FD.*ringflow-run"):
        read_secret({})


@pytest.mark.parametrize("content", [b"", b"not hex\n", b"\xff\xfe"])
def test_read_secret_bad_content(tmp_path, content: bytes) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"RINGFLOW_SECRET_FILE.*hex") as info:
        read_secret({"RINGFLOW_SECRET_FILE": str(path)})
    assert "not hex" not in str(info.value)  # the content is never echoed


def test_read_secret_unreadable(tmp_path) -> None:
    with pytest.raises(ConfigError, match="RINGFLOW_SECRET_FILE"):
        read_secret({"RINGFLOW_SECRET_FILE": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="RINGFLOW_SECRET_FD"):
        read_secret({"RINGFLOW_SECRET_FD": "x"})


def test_connect(tmp_path) -> None:
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret.hex() + "\n")
    path.chmod(0o600)
    with StoreServer(secret) as server:
        env = {
            "RINGFLOW_RENDEZVOUS_ADDR": server.host,
            "RINGFLOW_RENDEZVOUS_PORT": str(server.port),
            "RINGFLOW_SECRET_FILE": str(path),
        }
        with connect(env, timeout=5) as store:
            store.set("k", b"v")
            assert store.get("k") == b"v"


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({}, "RINGFLOW_RENDEZVOUS_ADDR and RINGFLOW_RENDEZVOUS_PORT"),
        ({"RINGFLOW_RENDEZVOUS_ADDR": "h", "RINGFLOW_RENDEZVOUS_PORT": "x"}, "not a port"),
        ({"RINGFLOW_RENDEZVOUS_ADDR": "h", "RINGFLOW_RENDEZVOUS_PORT": "70000"}, "not a port"),
    ],
)
def test_connect_bad_env(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        connect(env)
