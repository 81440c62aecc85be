"""Relaying a worker's output live, ``\\r`` progress bars included, with a prefix per segment.

A worker's stdout or stderr is cut into *segments*: text ended by ``\\n`` (a line) or by ``\\r``
(a progress-bar update: tqdm and Keras write ``\\r`` then the bar, and later ``\\r`` and the next
one). Each segment reaches the launcher's stream with the rank's prefix in front, when it ends;
and a bar (text after a ``\\r``) still unended after :data:`HOLD_S` is shown as it is, so that
it does not wait for a newline that may come minutes later. Other unended text waits for its
``\\n`` as before (or the end of the stream): a line that a worker writes in pieces (``python
-u`` writes the text and the ``\\n`` separately, a program prints ``part`` and later ``ial``)
stays one line when other ranks write meanwhile.

All the relays of a job share one :class:`Screen`: the terminal that stdout and stderr usually
are. A relay whose segment is open on it (text shown without its ``\\n``, or a bar ended by
``\\r`` with the cursor at its start) owns the line; before any other relay writes, the line is
ended with ``\\n``, so a bar stays visible and is never overwritten by another rank's line (if
the owner goes on, it shows its segment again, whole, after its prefix). In a file, the bytes
are what the worker wrote, with the prefix after each ``\\r`` and ``\\n``:
``[0]:  10%\\r[0]:  20%\\r[0]: 100%\\n``. ``\\r\\n`` is one line end. Invalid UTF-8 is replaced,
never fatal; a multi-byte character is never cut when unended text is shown.

The failure report's tail keeps the lines, and of a run of bar updates only the last.
"""

from __future__ import annotations

import collections
import contextlib
import select
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["HOLD_S", "Relay", "Screen", "pump"]

#: How long unended text waits for the rest of its segment before it is shown as it is: longer
#: than the gap between two writes of one print (microseconds), far shorter than anyone notices.
HOLD_S = 0.05


class Screen:
    """What the relays of one job share: a lock, and the relay whose segment is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: Relay | None = None


class Relay:
    """One worker stream's relay to ``out`` (text); see the module doc.

    ``prefix()`` is called for each segment shown (a timestamp may change); ``tail`` receives
    finished lines (the failure report's).
    """

    def __init__(self, out: IO[str], prefix: Callable[[], str], screen: Screen,
                 tail: collections.deque[str] | None = None) -> None:
        self._out = out
        self._prefix = prefix
        self._screen = screen
        self._tail = tail
        self._tail_bar = False  # the tail's last entry is a bar (replaced by the next one)
        self._line = b""  # the open segment, not yet ended
        self._shown = 0  # bytes of it already on the screen, after a prefix
        self._seen = 0  # bytes of it shown on a line that another relay's output ended
        self._at_bar = False  # the screen's cursor is at the start of this relay's last bar
        self._after_cr = False  # the open segment follows a \r: a bar, shown before it ends

    @property
    def pending(self) -> bool:
        """Whether unended text waits to be shown (see :meth:`show_pending`)."""
        return self._line.endswith(b"\r") or (self._after_cr and len(self._line) > self._shown)

    def feed(self, chunk: bytes) -> None:
        """Take ``chunk``; write every segment it ends."""
        data = self._line + chunk
        start = 0
        out: list[tuple[bytes, bytes]] = []
        n = len(data)
        i = len(self._line) - 1 if self._line.endswith(b"\r") else len(self._line)
        while i < n:
            byte = data[i]
            if byte == 0x0A:  # \n
                out.append((data[start:i], b"\n"))
                start = i + 1
            elif byte == 0x0D:  # \r: a line end if \n follows; wait and see at the very end
                if i + 1 == n:
                    break
                if data[i + 1] == 0x0A:
                    out.append((data[start:i], b"\n"))
                    i += 1
                else:
                    out.append((data[start:i], b"\r"))
                start = i + 1
            i += 1
        self._line = data[start:]
        if out:
            with self._screen.lock:
                for text, end in out:
                    self._end(text, end)

    def show_pending(self) -> None:
        """Show the unended text now (it has waited :data:`HOLD_S`)."""
        with self._screen.lock:
            if self._line.endswith(b"\r"):  # no \n came after it: a bar's end
                text, self._line = self._line[:-1], b""
                self._end(text, b"\r")
                return
            cut = _complete(self._line)
            if not self._after_cr or cut <= self._shown:
                return
            self._claim()
            head = self._prefix() if self._shown == 0 else ""
            self._write(head + self._line[self._shown:cut].decode("utf-8", "replace"))
            self._shown, self._seen = cut, 0
            self._screen.open = self

    def close(self) -> None:
        """End of the stream: what is left is a last line."""
        with self._screen.lock:
            text, self._line = self._line, b""
            if text.endswith(b"\r"):
                text = text[:-1]
            if text or self._shown:
                self._end(text, b"\n")
            if self._screen.open is self:
                self._screen.open = None

    # under the screen's lock ------------------------------------------------------------------
    def _end(self, text: bytes, end: bytes) -> None:
        """Write the segment ``text`` (all of it: shown or not) and its end."""
        self._after_cr = end == b"\r"
        if end == b"\r" and not text and not self._shown:
            return  # a bar's leading \r: nothing on the screen to go back over
        if not self._shown and self._seen >= len(text) > 0:
            # All of it is on the screen already, on a line ended for another relay's output.
            self._seen, self._at_bar = 0, False
            self._to_tail(text.decode("utf-8", "replace"), bar=end == b"\r")
            return
        self._claim()
        head = self._prefix() if self._shown == 0 else ""
        body = text[self._shown:].decode("utf-8", "replace")
        self._write(head + body + end.decode())
        self._shown = self._seen = 0
        self._at_bar = end == b"\r"
        self._screen.open = self if self._at_bar else None
        self._to_tail(text.decode("utf-8", "replace"), bar=self._at_bar)

    def _claim(self) -> None:
        """Another relay's open line ends here, so that this one's output starts a line."""
        other = self._screen.open
        if other is not None and other is not self:
            other._write("\n")
            other._seen, other._shown = other._shown, 0
            other._at_bar = False
            self._screen.open = None

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._out.write(text)
            self._out.flush()

    def _to_tail(self, text: str, bar: bool) -> None:
        if self._tail is None:
            return
        if bar and self._tail_bar and self._tail:
            self._tail.pop()  # the bar's previous state
        self._tail.append(text)
        self._tail_bar = bar


def _complete(data: bytes) -> int:
    """The length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte < 0x80:
            return n
        if byte >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return n if back >= need else n - back
    return n


def pump(stream: IO[bytes], relay: Relay | None, raw: IO[bytes] | None = None,
         tail: collections.deque[str] | None = None, hold_s: float = HOLD_S) -> None:
    """Read ``stream`` to its end into ``relay``, showing unended text after ``hold_s``.

    With ``raw`` instead (``--output-filename``), the bytes go there unchanged as they come,
    and ``tail`` gets the lines."""
    if relay is None or raw is not None:
        relay = Relay(_Discard(), str, Screen(), tail)  # type: ignore[arg-type]
    try:
        fd: int | None = stream.fileno()
    except (OSError, ValueError, AttributeError):
        fd = None
    with contextlib.suppress(OSError, ValueError):
        while True:
            if relay.pending and fd is not None and raw is None:
                ready, _, _ = select.select([fd], [], [], hold_s)
                if not ready:
                    relay.show_pending()
                    continue
            chunk = stream.read(65536)
            if not chunk:
                break
            if raw is not None:
                with contextlib.suppress(OSError, ValueError):
                    raw.write(chunk)
                    raw.flush()
            relay.feed(chunk)
    relay.close()


class _Discard:
    """The text stream of a relay kept only for its tail."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
