"""TCP ports for the rendezvous store: find a free one, or check that a named one is free."""

from __future__ import annotations

import os
import socket

from meshtrain.errors import ConfigError


def _addresses(host: str, port: int) -> list[tuple]:
    """(family, type, proto, address) for each address of `host` (localhost: v4 and v6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys((fam, kind, proto, addr) for fam, kind, proto, _, addr in infos))


def _bind(family: int, kind: int, proto: int, address: tuple) -> socket.socket:
    """Bind a TCP socket the way the store will (SO_REUSEADDR on) and return it."""
    sock = socket.socket(family, kind, proto)
    try:
        # TCPStore sets SO_REUSEADDR too, so a port left in TIME_WAIT counts as free, while a
        # port that some process listens on still fails to bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that is free now (the OS picks it by binding port 0).

    Another process could take it before it is used; callers bind it soon after.
    """
    with _bind(*_addresses(host, 0)[0]) as sock:
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise `ConfigError` when `port` on `host` cannot be bound because something else uses it."""
    if not 0 < port < 65536:
        raise ConfigError(
            f"port {port} is not a valid TCP port: pick one in 1..65535 with --master-port / "
            "--rdzv-endpoint, or leave it out to get a free one"
        )
    try:
        addresses = _addresses(host, port)
    except socket.gaierror as exc:
        raise ConfigError(
            f"host {host!r} cannot be resolved ({exc.strerror or exc}): check the host in "
            "--master-addr / --rdzv-endpoint"
        ) from exc
    try:
        for address in addresses:
            _bind(*address).close()
    except OSError as exc:
        raise ConfigError(
            f"port {port} on {host} is in use ({exc.strerror or exc}"
            f"{f'; {holder}' if (holder := port_holder(port)) else ''}): pick another with "
            "--master-port / --rdzv-endpoint or leave it out to get a free one (in a script "
            "`meshtrain slurm` wrote: meshtrain slurm --port PORT, or no --port)"
        ) from exc


def port_holder(port: int) -> str | None:
    """Which process on this machine listens on TCP ``port``: "pid N (name)", or None when it
    cannot be told (not Linux, another user's process, nothing listening)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN
            if len(fields) > 9 and fields[3] == "0A" and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/comm") as f:
                    return f"pid {pid} ({f.read().strip()})"
        except OSError:
            continue
    return None
