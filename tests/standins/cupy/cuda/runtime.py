"""The stand-in's ``cupy.cuda.runtime``: device count and properties."""

from __future__ import annotations

from typing import Any


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, text: str = "") -> None:
        self.status = status
        super().__init__(text or f"CUDA error {status}")


def getDeviceCount() -> int:
    from . import _count

    return _count()


def getDeviceProperties(device: int) -> dict[str, Any]:
    from . import Device, uuid_of

    Device(device)  # raises for a bad index
    return {"name": b"cupy stand-in", "uuid": uuid_of(int(device)), "pciBusID": device + 1,
            "totalGlobalMem": 1 << 34}


def getDevice() -> int:
    from . import get_device_id

    return get_device_id()
