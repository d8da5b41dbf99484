"""Waits that say what they wait for. A process of a job that waits for another one (a store to
answer, ranks or nodes to join) says so within seconds and then periodically ("waiting for 1 of
2 ranks (rank 1) to join the store at 127.0.0.1:29500, 5 s of 600 s"), and says what is wrong
when the wait cannot end: nothing listens at the address (connection refused: not started yet, or
a wrong port), or something answers there that is not a c10d store (another program holds the
port).

Used by the workers' start (launch/spawn.py: the store, then every rank joining it, before the
process group) and by `meshtrain run`'s agents (launch/rdzv_watch.py, launch/rendezvous.py).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections.abc import Callable

from meshtrain.errors import ConfigError, MeshtrainError

FIRST_REPORT_S = 5.0  # the first "waiting for ..." line comes after this long
REPORT_EVERY_S = 30.0  # then one every this long
#: The first bytes a torch TCPStore client sends (torch/csrc/distributed/c10d/TCPStore.cpp):
#: VALIDATE (query type 0) with the magic number, then PING (query type 13) with a nonce that a
#: store sends back. Unchanged from torch 2.4 to 2.13.
_VALIDATE = struct.pack("<BI", 0, 0x3C85F7CE)
_PING = 13


class WaitTimedOut(MeshtrainError, TimeoutError):
    """A process of the job waited its whole timeout for another one; names what it waited
    for."""


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Progress:
    """Say "waiting for WHAT, T s of N s" once ``first`` seconds have passed, then every
    ``every`` seconds; the caller calls :meth:`tick` from its poll loop."""

    def __init__(self, say: Callable[[str], None], timeout_s: float, prefix: str = "",
                 first: float = FIRST_REPORT_S, every: float = REPORT_EVERY_S):
        self.say, self.timeout_s, self.prefix = say, timeout_s, prefix
        self.start = time.monotonic()
        self.due = self.start + first
        self.every = every

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.timeout_s - self.elapsed()

    def tick(self, what: str) -> bool:
        """Say it if due; True when said."""
        now = time.monotonic()
        if now < self.due:
            return False
        self.due = now + self.every
        self.say(f"{self.prefix}waiting for {what}, {self.elapsed():.0f} s of "
                 f"{self.timeout_s:.0f} s")
        return True


def probe(host: str, port: int, timeout: float = 3.0) -> tuple[str, str]:
    """What answers at host:port: ("store", "") for a c10d TCPStore; ("refused", why) when
    nothing listens there (or the host cannot be reached); ("other", what) when something
    accepts connections but does not answer like a store."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused", "connection refused: nothing listens there"
    except socket.gaierror as error:
        return "refused", f"{host!r} does not resolve: {error}"
    except OSError as error:  # timed out, no route, ...
        return "refused", f"no connection: {error.strerror or error}"
    nonce = os.getpid() & 0xFFFFFFFF
    with sock:
        try:
            sock.sendall(_VALIDATE + struct.pack("<BI", _PING, nonce))
            answer = b""
            while len(answer) < 4:
                chunk = sock.recv(4 - len(answer))
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            return "other", f"it accepts connections but did not answer a store's ping in " \
                            f"{timeout:g} s"
        except OSError as error:
            return "other", f"it accepts connections, then {error.strerror or error}"
    if len(answer) == 4 and struct.unpack("<I", answer)[0] == nonce:
        return "store", ""
    if not answer:
        return "other", "it accepts connections and closes them without answering a store's ping"
    return "other", f"it answered a store's ping with {answer!r}"


def wait_for_store(host: str, port: int, timeout_s: float, *, who: str, fix: str,
                   taken_fix: str | None = None,
                   say: Callable[[str], None] = stderr_line) -> None:
    """Return once a c10d store answers at host:port. Meanwhile say every so often that this
    process waits for it (nothing listens there yet); raise ``ConfigError`` at once when
    something else answers there (``taken_fix``: what to do then), ``WaitTimedOut`` after
    ``timeout_s``. ``who`` names the store ("the store rank 0 hosts (MASTER_ADDR:MASTER_PORT)"),
    ``fix`` what to check."""
    progress = Progress(say, timeout_s, prefix=f"meshtrain: {_me()}")
    while True:
        kind, why = probe(host, port)
        if kind == "store":
            return
        if kind == "other":
            from meshtrain.launch.ports import port_holder

            holder = port_holder(port) if _is_local(host) else None
            raise ConfigError(f"{host}:{port} is held by a program that is not a c10d store "
                              f"({why}{f'; it is {holder}' if holder else ''}), where {who} "
                              f"should be: {taken_fix or fix}")
        if progress.left() <= 0:
            raise WaitTimedOut(f"{_me()}no store answered at {host}:{port} within "
                               f"{timeout_s:.0f} s ({why}); {who} should be there: {fix}")
        progress.tick(f"{who} at {host}:{port} ({why} yet)")
        time.sleep(min(1.0, max(0.05, progress.left())))


def join(store, rank: int, world_size: int, timeout_s: float, *, where: str,
         say: Callable[[str], None] = stderr_line, generation: int = 0) -> None:
    """Every rank of ``world_size`` marks itself in ``store``, then waits for the others,
    polling a counter (every 0.1 s at most for 10 s, then every second: a timed-out
    ``store.wait`` would log a C++ warning each time). Rank 0 says which ranks it waits for
    after 10 s and then every 30 s; after ``timeout_s`` each rank raises ``WaitTimedOut``
    naming the missing ranks."""
    prefix = f"meshtrain_join/{generation}"
    store.set(f"{prefix}/rank{rank}", "1")
    count = store.add(f"{prefix}/count", 1)
    # (first said after 10 s: ranks that start together arrive within seconds of each other)
    progress = Progress(say, timeout_s, prefix=f"meshtrain: rank {rank}: ", first=10.0)
    pause = 0.01
    while count < world_size:
        if progress.left() <= 0:
            missing = _missing(store, prefix, world_size)
            raise WaitTimedOut(
                f"rank {rank}: {_ranks(missing, world_size)} did not join the job's store at "
                f"{where} within {timeout_s:.0f} s (init_timeout_s): were they started, with "
                "the same address and port of the store (MASTER_ADDR:MASTER_PORT) and the "
                "same WORLD_SIZE? A rank that failed before it says why in its own output")
        if rank == 0 and time.monotonic() >= progress.due:
            missing = _missing(store, prefix, world_size)
            progress.tick(f"{_ranks(missing, world_size)} to join the job's store at {where}")
        time.sleep(pause)
        pause = min(0.1 if progress.elapsed() < 10 else 1.0, pause * 2)
        count = store.add(f"{prefix}/count", 0)


def _missing(store, prefix: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"{prefix}/rank{r}"])]


def _ranks(missing: list[int], world_size: int) -> str:
    shown = ", ".join(str(r) for r in missing[:8]) + (", ..." if len(missing) > 8 else "")
    return f"{len(missing)} of {world_size} ranks (rank{'s' if len(missing) > 1 else ''} " \
        f"{shown})"


def _me() -> str:
    rank = os.environ.get("RANK")
    return f"rank {rank}: " if rank is not None else ""


def connect(host: str, port: int, world_size: int | None, timeout, *, who: str, fix: str):
    """A client of the c10d store at host:port, once one answers there (:func:`wait_for_store`,
    within ``timeout``, a timedelta)."""
    import torch.distributed as dist

    wait_for_store(host, port, timeout.total_seconds(), who=who, fix=fix)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def address(store) -> str:
    """host:port of the TCPStore under ``store`` (through PrefixStores); "the store" else."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host and port else "the store"


def _is_local(host: str) -> bool:
    from meshtrain.launch.network import ipv4_addresses, is_loopback

    try:
        return is_loopback(host) or host in ipv4_addresses().values()
    except ConfigError:
        return False
