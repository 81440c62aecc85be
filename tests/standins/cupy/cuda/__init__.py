"""The stand-in's ``cupy.cuda``: devices, streams, events, pinned memory (see ../../README.md).

``CUPY_STANDIN_DEVICES`` devices (default 1), each with a UUID made of the host name and its
index, so that ranks on one host that use the same index share a device, as real ones would.
The current device and stream are per thread, as in cupy. Kernels (array operations) run at
once on the calling thread; NCCL calls run on a thread of their communicator, and an event
recorded on a stream is done once the NCCL work queued on that stream before it has finished.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import weakref
from typing import Any

from . import runtime

_local = threading.local()
_ptrs = itertools.count(0x7F000000)
_streams: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()


def queue_on(ptr: int) -> threading.Event:
    """A flag that the work being queued on stream ``ptr`` sets when it has finished."""
    stream = _streams.get(int(ptr), Stream.null)
    flag = threading.Event()
    stream._queued = [f for f in stream._queued if not f.is_set()] + [flag]
    return flag


def _count() -> int:
    return int(os.environ.get("CUPY_STANDIN_DEVICES", "1"))


def uuid_of(index: int) -> bytes:
    """16 bytes naming device ``index`` of this host."""
    return f"{socket.gethostname()}/{index}".encode().ljust(16, b"\0")[:16]


class Device:
    def __init__(self, device: int | None = None) -> None:
        if device is None:
            device = getattr(_local, "device", 0)
        device = int(device)
        if not 0 <= device < _count():
            raise runtime.CUDARuntimeError(101, "cudaErrorInvalidDevice: invalid device ordinal")
        self.id = device
        self._previous: list[int] = []

    @property
    def pci_bus_id(self) -> str:
        return f"0000:{self.id + 1:02x}:00.0"

    def use(self) -> None:
        _local.device = self.id

    def __enter__(self) -> Device:
        self._previous.append(getattr(_local, "device", 0))
        _local.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.device = self._previous.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def synchronize(self) -> None:
        pass


def get_device_id() -> int:
    return getattr(_local, "device", 0)


class Stream:
    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False
                 ) -> None:
        self.ptr = 0 if null else next(_ptrs)
        self.non_blocking = non_blocking
        self._previous: list[Stream] = []
        self._queued: list[threading.Event] = []
        _streams[self.ptr] = self

    def __enter__(self) -> Stream:
        self._previous.append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.stream = self._previous.pop()

    def use(self) -> Stream:
        _local.stream = self
        return self

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, Event):
            raise TypeError(f"Argument 'event' has incorrect type (expected cupy.cuda.stream."
                            f"Event, got {type(event).__name__})")

    def record(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__()
        self.ptr = int(ptr)
        _streams[self.ptr] = self


def get_current_stream(device_id: int = -1) -> Stream:
    return getattr(_local, "stream", Stream.null)


class Event:
    """Done once the NCCL work queued on its stream before it has finished (kernels finish at
    once); its first query says "not yet", so that every polling loop goes round at least
    once."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self._after: list[threading.Event] = []
        self._asked = False

    def record(self, stream: Stream | None = None) -> None:
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError("Argument 'stream' has incorrect type")
        self._after = list((get_current_stream() if stream is None else stream)._queued)
        self._asked = False

    @property
    def done(self) -> bool:
        if not self._asked:
            self._asked = True
            return False
        return all(flag.is_set() for flag in self._after)

    def synchronize(self) -> None:
        for flag in self._after:
            flag.wait()


def alloc_pinned_memory(size: int) -> bytearray:
    return bytearray(int(size))


def is_available() -> bool:
    return _count() > 0


__all__ = ["Device", "Event", "ExternalStream", "Stream", "alloc_pinned_memory",
           "get_current_stream", "runtime"]
