"""Which local address the rendezvous store listens on, and interface addresses.

:func:`store_address` decides where a job's store listens:

* every host is this machine -> ``127.0.0.1`` (DESIGN.md section 5: a single-host job never listens
  beyond loopback);
* ``--network-interface NAME`` -> that interface's IPv4 address (:func:`interface_ipv4`);
* otherwise the source address of the route to the first remote host, found with a UDP
  ``connect()``, which sends nothing: the address the remote workers can reach this host on.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Iterable

from ..errors import LaunchError

__all__ = ["interface_ipv4", "store_address"]

_SIOCGIFADDR = 0x8915  # linux/sockios.h


def interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), e.g. ``"10.0.0.5"`` for ``eth0``.

    Raises:
        LaunchError: no interface of that name, or it has no IPv4 address.
    """
    encoded = name.encode()
    if not encoded or len(encoded) > 15:
        raise LaunchError(
            f"--network-interface {name!r} is not an interface name (1 to 15 bytes); "
            "list them with `ip -brief address`"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", encoded))
        except OSError as exc:
            raise LaunchError(
                f"--network-interface {name!r}: no IPv4 address on an interface of that name on "
                f"{socket.gethostname()} ({exc.strerror}); list them with `ip -brief address`"
            ) from None
    return socket.inet_ntoa(raw[20:24])


def store_address(remote_hosts: Iterable[str], interface: str | None = None) -> str:
    """The address to listen on for a job whose non-local hosts are ``remote_hosts``.

    Raises:
        LaunchError: the interface has no address, or no remote host resolves.
    """
    remote = list(remote_hosts)
    if not remote:
        return "127.0.0.1"
    if interface:
        return interface_ipv4(interface)
    errors = []
    for host in remote:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return str(probe.getsockname()[0])
        except OSError as exc:
            errors.append(f"{host}: {exc}")
    raise LaunchError(
        f"cannot find the address the hosts {remote} reach this machine on ({'; '.join(errors)}); "
        "pass --network-interface NAME (the interface that connects the hosts)"
    )
