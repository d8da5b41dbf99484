"""Where a job listens: on one machine only the loopback interface, across machines the interface
the user names or the one that reaches the rendezvous host.

Three things listen while a job trains: the rendezvous ``TCPStore`` (no authentication: whoever
reaches it can read and write the job's keys), gloo's or NCCL's sockets, and the parameter
servers' RPC (TensorPipe). torch's store binds every interface whatever host it is given, and gloo
picks the address the machine's host name resolves to. So:

* :func:`listening_socket` binds the store's socket ourselves (to 127.0.0.1 on one machine, to
  MASTER_ADDR's own address across machines) and the store serves on it (``master_listen_fd``);
* :func:`choose_interfaces` sets ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` and
  ``TP_SOCKET_IFNAME`` (TensorPipe) to that interface, unless the user set them.

docs/security.md says what each launcher exposes.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import warnings
from pathlib import Path

from meshtrain.errors import ConfigError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
IFF_LOOPBACK = 0x8  # <linux/if.h>


def addresses(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to (itself when it is one)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror as error:
        raise ConfigError(f"MASTER_ADDR={host!r} does not resolve ({error}); give the rendezvous "
                          "host's name or address") from None


def is_loopback(host: str) -> bool:
    """Does ``host`` name this machine's loopback (127.0.0.1, ::1, localhost)?"""
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses(host))


def loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    for _, name in socket.if_nameindex():
        flags = Path(f"/sys/class/net/{name}/flags")
        if flags.is_file() and int(flags.read_text(), 16) & IFF_LOOPBACK:
            return name
    names = [name for _, name in socket.if_nameindex()]
    return "lo0" if "lo0" in names else "lo"


def ipv4_addresses() -> dict[str, str]:
    """This machine's interfaces that have an IPv4 address: {name: address} (Linux)."""
    import fcntl
    import struct

    siocgifaddr, found = 0x8915, {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def _interface_of(address: str) -> str | None:
    """The name of this machine's interface that has IPv4 ``address``."""
    return next((name for name, mine in ipv4_addresses().items() if mine == address), None)


def interface_reaching(host: str) -> tuple[str, str]:
    """(interface name, its address): where this machine sends packets for ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # UDP: no packet is sent, the route is looked up
        except OSError as error:
            raise ConfigError(f"no route from this machine to MASTER_ADDR={host!r} ({error}); "
                              f"set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the "
                              "interface the job should use") from None
        address = probe.getsockname()[0]
    name = _interface_of(address)
    if name is None:
        raise ConfigError(f"could not tell which interface has {address}, the address that "
                          f"reaches MASTER_ADDR={host!r}; set GLOO_SOCKET_IFNAME (and "
                          "NCCL_SOCKET_IFNAME on GPUs) to the interface the job should use")
    return name, address


def choose_interfaces(master_addr: str, environ=None) -> str:
    """Set the ``IFNAME_VARS`` the user left unset to the interface this job should use and
    return one line saying which (printed at start): the one named in ``GLOO_SOCKET_IFNAME``,
    else loopback when ``master_addr`` is this machine's loopback, else the interface that
    reaches it."""
    environ = os.environ if environ is None else environ
    given = {var: environ[var] for var in IFNAME_VARS if environ.get(var)}
    if "GLOO_SOCKET_IFNAME" in given:
        name, why = given["GLOO_SOCKET_IFNAME"], "named by GLOO_SOCKET_IFNAME"
    elif is_loopback(master_addr):
        name, why = loopback_interface(), "loopback only: every process is on this machine"
    else:
        try:
            name, address = interface_reaching(master_addr)
        except ConfigError as error:  # torch's own choice then, said at start
            return f"network: torch's default interfaces ({error})"
        why = f"{address}, the interface that reaches MASTER_ADDR={master_addr}"
    for var in IFNAME_VARS:
        environ.setdefault(var, name)
    others = {k: v for k, v in given.items() if k != "GLOO_SOCKET_IFNAME"}
    yours = f"; kept yours: {', '.join(f'{k}={v}' for k, v in others.items())}" if others else ""
    return f"network: {name} ({why}{yours})"


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host``'s own address (127.0.0.1 for a loopback host; else the
    first of its addresses this machine has), for a ``TCPStore`` server
    (``master_listen_fd=sock.detach()``; the store then owns it). When ``host`` is not an
    address of this machine (rank 0 behind NAT, reached at another address), every interface,
    as torch would, with a warning; a port in use is a ConfigError."""
    candidates = ["127.0.0.1"] if is_loopback(host) else addresses(host)
    for address in candidates:
        try:
            return _listen(address, port)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {address} is in use: MASTER_PORT must be a "
                                  "free port on rank 0's machine") from None
    warnings.warn(f"MASTER_ADDR={host} ({', '.join(candidates)}) is not an address of this "
                  f"machine: the rendezvous store listens on every interface (port {port}); "
                  "see docs/security.md", stacklevel=2)
    return _listen("", port)


def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock
