"""The point-to-point matcher (ringflow.p2p.PointToPoint) of two ranks wired to each other in one
thread: every frame is encoded, decoded and delivered at once, so each test sees exactly the
protocol's messages. Chunks of 8 bytes make every path of a message in several chunks run:
received where it is expected or buffered, into ``out`` or a fresh array, matched before, while
or after it arrives."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow.errors import MismatchError, PeerError, ShutdownError, TensorError
from ringflow.messages import P2PData, P2PReply, decode
from ringflow.p2p import PointToPoint


class Pair:
    """Ranks 0 and 1 of a job of 2; ``held`` frames are not delivered until released."""

    def __init__(self, chunk: int = 8) -> None:
        self.stats: list[dict[str, int]] = [{}, {}]
        self.frames: list[tuple[int, int, object]] = []  # (src, dst, message) as delivered
        self.hold = False
        self.held: list[tuple[int, int, object]] = []
        self.ranks = [PointToPoint(r, 2, self._sender(r), self.stats[r], chunk) for r in (0, 1)]

    def _sender(self, src: int):
        def send(payload: bytes, dst: int) -> None:
            msg = decode(payload)
            if self.hold:
                self.held.append((src, dst, msg))
                return
            self.frames.append((src, dst, msg))
            self.ranks[dst].on_message(src, msg)

        return send

    def release(self) -> None:
        self.hold = False
        held, self.held = self.held, []
        for src, dst, msg in held:
            self.frames.append((src, dst, msg))
            self.ranks[dst].on_message(src, msg)


@pytest.mark.parametrize("length", [0, 1, 3, 25])  # 25 float64: 200 bytes in 25 chunks
@pytest.mark.parametrize("posted_first", [True, False])
@pytest.mark.parametrize("into_out", [True, False])
def test_a_message_is_received_whole_whichever_side_comes_first(
        length: int, posted_first: bool, into_out: bool) -> None:
    p = Pair()
    x = np.arange(length, dtype=np.float64) * 1.5
    out = np.empty(length) if into_out else None
    if posted_first:
        r = p.ranks[1].irecv(0, 4, out)
        s = p.ranks[0].isend(x, 1, 4)
    else:
        s = p.ranks[0].isend(x, 1, 4)
        assert not s.poll()  # a send completes when the receiver has the data
        r = p.ranks[1].irecv(0, 4, out)
    got = r.wait(1)
    assert s.wait(1) is None and s.is_completed()
    assert np.array_equal(got, x) and got.dtype == x.dtype
    assert got is out if into_out else got.shape == (length,)
    data = [m for _, _, m in p.frames if isinstance(m, P2PData)]
    assert len(data) == max(1, length)  # one float64 per 8-byte chunk, at least one frame
    replies = [m for _, _, m in p.frames if isinstance(m, P2PReply)]
    assert replies == [P2PReply(4, 0, "", "")]
    assert r.seq == s.seq == 0


@pytest.mark.parametrize("into_out", [True, False])
def test_a_receive_matched_while_its_message_arrives(into_out: bool) -> None:
    p = Pair()
    x = np.arange(10, dtype=np.int32)
    p.hold = True
    s = p.ranks[0].isend(x, 1, 0)
    held = p.held
    p.hold = False
    p.held = []
    for src, dst, msg in held[:2]:  # 2 of 5 chunks, unexpected
        p.ranks[dst].on_message(src, msg)
    out = np.empty(10, np.int32) if into_out else None
    r = p.ranks[1].irecv(0, 0, out)
    assert not r.poll()
    for src, dst, msg in held[2:]:
        p.ranks[dst].on_message(src, msg)
    assert np.array_equal(r.wait(1), x) and s.wait(1) is None


def test_messages_of_one_tag_are_matched_in_order_and_tags_apart() -> None:
    p = Pair()
    sends = [p.ranks[0].isend(np.full(3, i), 1, i % 2) for i in range(6)]
    got_odd = [int(p.ranks[1].irecv(0, 1).wait(1)[0]) for _ in range(3)]
    posted = [p.ranks[1].irecv(0, 0) for _ in range(3)]
    assert got_odd == [1, 3, 5] and [int(h.wait(1)[0]) for h in posted] == [0, 2, 4]
    assert all(s.poll() for s in sends)
    assert p.stats[1]["p2p_received"] == 6 and p.stats[0]["p2p_sent"] == 6


def test_shape_gives_the_receivers_layout() -> None:
    p = Pair()
    p.ranks[0].isend(np.arange(6.0), 1, 0)
    got = p.ranks[1].irecv(0, 0, shape=(2, 3), dtype=np.dtype(np.float64)).wait(1)
    assert got.shape == (2, 3) and np.array_equal(got.ravel(), np.arange(6.0))


@pytest.mark.parametrize("kwargs", [{"shape": (4,)}, {"dtype": np.dtype(np.float32)},
                                    {"out": np.empty(5, np.int64)}])
def test_a_mismatch_fails_both_sides_with_one_text_and_drops_the_message(kwargs: dict) -> None:
    p = Pair()
    s = p.ranks[0].isend(np.arange(5.0), 1, 2)
    r = p.ranks[1].irecv(0, 2, **kwargs)
    with pytest.raises(MismatchError) as sent:
        s.wait(1)
    with pytest.raises(MismatchError) as received:
        r.wait(1)
    assert str(sent.value) == str(received.value)
    assert "rank 0 sent 5 elements of float64 (shape (5,))" in str(sent.value)
    s = p.ranks[0].isend(np.arange(3.0), 1, 2)  # the next message goes through
    assert np.array_equal(p.ranks[1].irecv(0, 2).wait(1), np.arange(3.0)) and s.poll()


def test_a_mismatch_of_a_chunked_message_discards_its_remaining_chunks() -> None:
    p = Pair()
    r = p.ranks[1].irecv(0, 0, shape=(2,))
    s = p.ranks[0].isend(np.arange(7.0), 1, 0)
    with pytest.raises(MismatchError):
        r.wait(1)
    with pytest.raises(MismatchError):
        s.wait(1)
    p.ranks[0].isend(np.arange(2.0), 1, 0)
    assert np.array_equal(p.ranks[1].irecv(0, 0).wait(1), np.arange(2.0))


def test_what_the_sender_cannot_send_fails_the_matching_receive_with_its_text() -> None:
    p = Pair()
    s = p.ranks[0].isend(None, 1, 0, error="tensor has dtype complex128")
    with pytest.raises(TensorError, match="complex128"):
        s.wait(1)
    with pytest.raises(TensorError, match="complex128"):
        p.ranks[1].irecv(0, 0).wait(1)


def test_a_peer_failure_fails_what_is_pending_with_it_and_later_receives() -> None:
    p = Pair()
    p.hold = True
    s = p.ranks[0].isend(np.ones(3), 1, 0)  # its frames never arrive
    p.hold = False
    r = p.ranks[0].irecv(1, 0)
    p.ranks[0].peer_failed(1, PeerError("lost rank 1: it exited"))
    for h in (s, r):
        with pytest.raises(PeerError, match="lost rank 1"):
            h.wait(1)
    with pytest.raises(PeerError, match="lost rank 1"):
        p.ranks[0].irecv(1, 5).wait(1)
    with pytest.raises(PeerError, match="lost rank 1"):
        p.ranks[0].isend(np.ones(1), 1, 5).wait(1)


def test_a_message_that_arrived_before_the_goodbye_can_still_be_received() -> None:
    p = Pair()
    p.ranks[1].isend(np.arange(3), 0, 9)
    p.ranks[0].peer_failed(1, ShutdownError("rank 1 has shut down"))
    assert np.array_equal(p.ranks[0].irecv(1, 9).wait(1), np.arange(3))


def test_close_fails_everything_pending_and_later_calls_raise_at_the_call() -> None:
    p = Pair()
    p.hold = True
    s = p.ranks[0].isend(np.ones(3), 1, 0)
    r = p.ranks[0].irecv(1, 0)
    error = PeerError("rank 2 has not responded for 3 s")
    p.ranks[0].close(error)
    for h in (s, r):
        with pytest.raises(PeerError, match="has not responded"):
            h.wait(1)
    with pytest.raises(PeerError, match="has not responded"):
        p.ranks[0].isend(np.ones(1), 1, 0)
    with pytest.raises(PeerError, match="has not responded"):
        p.ranks[0].irecv(1, 0)


def test_gradient_tags_are_a_space_of_their_own() -> None:
    p = Pair()
    p.ranks[0].isend(np.full(2, 1.0), 1, 7)
    p.ranks[0].isend(np.full(2, 2.0), 1, (7, 0))
    assert p.ranks[1].irecv(0, (7, 0)).wait(1)[0] == 2.0
    assert p.ranks[1].irecv(0, 7).wait(1)[0] == 1.0
