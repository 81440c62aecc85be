"""The launcher's output relay: segments ended by \\n or \\r, each with its prefix, live."""

from __future__ import annotations

import collections
import io
import os
import threading
import time

import pytest

from ringflow.runner.relay import Relay, Screen, pump

pytestmark = pytest.mark.timeout(30)


def relays(n: int = 1) -> tuple[io.StringIO, list[Relay], list[collections.deque[str]]]:
    out, screen = io.StringIO(), Screen()
    tails = [collections.deque[str](maxlen=20) for _ in range(n)]
    return out, [Relay(out, lambda r=r: f"[{r}]:", screen, tails[r]) for r in range(n)], tails


def test_lines_are_prefixed_and_a_line_in_pieces_stays_one_line() -> None:
    out, (r,), (tail,) = relays()
    r.feed(b"a\nb")
    r.feed(b"c\r\nd\r")  # \r\n is one line end; a \r at the end may be the first half of one
    assert out.getvalue() == "[0]:a\n[0]:bc\n"
    r.feed(b"\n")
    r.close()
    assert out.getvalue() == "[0]:a\n[0]:bc\n[0]:d\n"
    assert list(tail) == ["a", "bc", "d"]


def test_a_progress_bar_is_shown_before_any_newline() -> None:
    out, (r,), (tail,) = relays()
    r.feed(b"\r 10%|#")  # tqdm: \r, then the bar, then nothing until the next update
    assert out.getvalue() == ""  # held for HOLD_S: the rest of a line may follow at once
    assert r.pending
    r.show_pending()
    assert out.getvalue() == "[0]: 10%|#"
    r.feed(b"\r 20%|##")
    r.show_pending()
    r.feed(b"\r100%|###\n")
    assert out.getvalue() == "[0]: 10%|#\r[0]: 20%|##\r[0]:100%|###\n"
    assert list(tail) == [" 20%|##", "100%|###"]  # of a run of bar updates, the last


def test_keras_style_bars_end_with_cr_and_show_at_once() -> None:
    out, (r,), _ = relays()
    r.feed(b"1/3 [==>...]\r")
    assert out.getvalue() == ""  # a trailing \r could be half of \r\n ...
    r.show_pending()  # ... until HOLD_S passed
    r.feed(b"2/3 [=====>]\r3/3 [=======]\n")
    assert out.getvalue() == "[0]:1/3 [==>...]\r[0]:2/3 [=====>]\r[0]:3/3 [=======]\n"


def test_another_rank_never_writes_over_an_open_bar() -> None:
    out, (bar, other), _ = relays(2)
    bar.feed(b"\r 10%")
    bar.show_pending()
    other.feed(b"hello\n")  # the bar's line is ended first, so it stays on the screen
    bar.feed(b"\r 20%")
    bar.show_pending()
    bar.feed(b"\n")
    assert out.getvalue() == "[0]: 10%\n[1]:hello\n[0]: 20%\n"


def test_a_line_in_pieces_waits_for_its_newline_and_stays_one_line() -> None:
    out, (r, other), _ = relays(2)
    r.feed(b"part")
    assert not r.pending
    r.show_pending()
    other.feed(b"x\n")
    r.feed(b"ial\n")
    assert out.getvalue() == "[1]:x\n[0]:partial\n"


def test_a_bar_cut_by_another_rank_is_shown_again_whole() -> None:
    out, (r, other), _ = relays(2)
    r.feed(b"\rloading")
    r.show_pending()
    other.feed(b"x\n")
    r.feed(b" done")
    r.show_pending()
    r.feed(b"\n")
    assert out.getvalue() == "[0]:loading\n[1]:x\n[0]:loading done\n"


def test_a_character_is_never_cut_and_bad_bytes_are_replaced() -> None:
    out, (r,), _ = relays()
    r.feed("\rcaf\u00e9".encode()[:-1])
    r.show_pending()
    assert out.getvalue() == "[0]:caf"
    r.feed(b"\xa9 \xff\n")
    assert out.getvalue() == "[0]:caf\u00e9 \ufffd\n"


def test_pump_shows_a_bar_while_the_writer_pauses() -> None:
    read, write = os.pipe()
    out, (r,), _ = relays()
    with os.fdopen(read, "rb", buffering=0) as stream:
        thread = threading.Thread(target=pump, args=(stream, r), kwargs={"hold_s": 0.02})
        thread.start()
        os.write(write, b"\rstep 1")
        end = time.monotonic() + 10
        while "step 1" not in out.getvalue() and time.monotonic() < end:
            time.sleep(0.01)
        assert out.getvalue() == "[0]:step 1"  # before any newline, while the writer waits
        os.write(write, b"\rstep 2\n")
        os.close(write)
        thread.join(10)
    assert out.getvalue() == "[0]:step 1\r[0]:step 2\n"


def test_pump_copies_raw_bytes_and_keeps_the_tail() -> None:
    read, write = os.pipe()
    raw, tail = io.BytesIO(), collections.deque[str](maxlen=5)
    os.write(write, b"a\r\nb\r10%\r20%\rc")
    os.close(write)
    with os.fdopen(read, "rb", buffering=0) as stream:
        pump(stream, None, raw=raw, tail=tail)
    assert raw.getvalue() == b"a\r\nb\r10%\r20%\rc"
    assert list(tail) == ["a", "20%", "c"]
