"""torchrun's c10d rendezvous as `meshtrain run` runs it (launch/torchrun.py): the store an
agent hosts bound to the endpoint's own address (127.0.0.1 on one host), several agents of one
job on one host, an agent that joins waiting for the store with words (not silently) and
refusing a port another program or job holds, and the rendezvous round passed to the workers
(with the store address torch 2.13 forgets to rewrite). What the agents say while they wait and
their heartbeats: launch/rdzv_watch.py."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import ROUND_ENV

LOCAL_HOST = "127.0.0.1"


@contextlib.contextmanager
def rendezvous_store(args: argparse.Namespace):
    """The c10d rendezvous store of a `meshtrain run` agent, hosted or joined here, before
    torchrun's rendezvous handler looks for it.

    Hosted where ``--rdzv-endpoint`` names this machine (unless ``--rdzv-conf is_host=0``), on
    a socket bound to that address only, not on every interface (torchrun's
    ``TCPStore(..., multi_tenant=True)`` on that port then reuses it: torch keeps one server per
    port in a process); the store is marked as this job's (``meshtrain/<id>/host``). When that
    port is taken, several agents of one job on this machine (``--nnodes 2`` at 127.0.0.1, e.g.
    to try a multi-node layout) are expected: the first to bind it hosts the store and the
    others join it. Joining (every agent that does not host) first waits for the store, saying
    so every so often (launch/waits.py); a port held by something that is not a c10d store, or
    by another job's store, is an error naming it, not a silent wait.

    On 127.0.0.1 the workers' bootstrap store, which the rendezvous handler creates on a free
    port, also listens on 127.0.0.1 only."""
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    host = host.strip("[]")
    if not (args.rdzv_backend == "c10d" and host and port.isdigit()):
        yield
        return
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from meshtrain.launch.network import listening_socket

    def bound_store(address: str, port: int):
        sock = listening_socket(address, port)
        return dist.TCPStore(address, sock.getsockname()[1], is_master=True,
                             multi_tenant=True, wait_for_workers=False,
                             master_listen_fd=sock.detach())

    is_host = rdzv_conf(args.rdzv_conf).get("is_host", "").lower()
    store = None
    if _is_this_machine(host) and is_host not in ("0", "false"):
        try:
            store = bound_store(host, int(port))
            store.set(_host_key(args), f"{socket.gethostname()} pid {os.getpid()}")
        except ConfigError:
            if max_nodes(args) == 1 or is_host in ("1", "true"):
                from meshtrain.launch.ports import port_holder

                holder = port_holder(int(port))
                held = f" ({holder})" if holder else ""
                raise ConfigError(f"port {port} on {host} is in use{held}: this agent cannot "
                                  f"host the rendezvous store there; {OTHER_PORT}") from None
    if store is None:
        join_rendezvous_store(host, int(port), args)
    loopback = host == LOCAL_HOST
    original = DynamicRendezvousHandler._create_tcp_store_server
    if loopback:
        DynamicRendezvousHandler._create_tcp_store_server = \
            lambda self, master_addr, master_port: bound_store(LOCAL_HOST, master_port)
    try:
        yield
    finally:
        DynamicRendezvousHandler._create_tcp_store_server = original
        del store


#: what to do when the rendezvous port is taken (by another job or program)
OTHER_PORT = ("pick another port: --rdzv-endpoint HOST:PORT (in a script `meshtrain slurm` "
              "wrote: meshtrain slurm --port PORT)")


def join_rendezvous_store(host: str, port: int, args: argparse.Namespace) -> None:
    """Wait until this job's rendezvous store answers at host:port (saying so every so
    often); refuse a port held by a program that is not a store, or by another job's store."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.launch.waits import wait_for_store

    timeout = float(rdzv_conf(args.rdzv_conf).get("join_timeout", 600))
    wait_for_store(host, port, timeout, who=f"the rendezvous store (the agent on {host} "
                   "hosts it)", fix="is that agent started, with the same --rdzv-endpoint?",
                   taken_fix=OTHER_PORT,
                   say=lambda text: print(text.replace("meshtrain: ", "meshtrain run: ", 1),
                                          file=sys.stderr, flush=True))
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    try:
        client.wait([_host_key(args)], timedelta(seconds=10))
    except (RuntimeError, TimeoutError, ValueError):
        raise ConfigError(
            f"the c10d store at {host}:{port} is not this job's: no `meshtrain run` agent of "
            f"rendezvous id {args.rdzv_id} hosts it (another job's rendezvous on that port?). "
            f"Two jobs on one node need different ports; {OTHER_PORT}") from None


def _host_key(args: argparse.Namespace) -> str:
    return f"meshtrain/{args.rdzv_id}/host"


def _is_this_machine(host: str) -> bool:
    """Does ``host`` name this machine (its loopback or one of its addresses)?"""
    from meshtrain.launch.network import addresses, ipv4_addresses, is_loopback

    try:
        return is_loopback(host) or bool(set(addresses(host)) & set(ipv4_addresses().values()))
    except ConfigError:  # does not resolve (yet): not this machine
        return False


def rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's ``--rdzv-conf k=v,k=v`` as a dict."""
    pairs = (item.split("=", 1) for item in (text or "").split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


@contextlib.contextmanager
def round_in_worker_env():
    """Two things after each c10d rendezvous of this agent.

    Its round number goes into the environment the agent gives its workers
    (``MESHTRAIN_RDZV_ROUND``), so that they namespace their process-group keys by round
    (launch/spawn.py). torchrun's restart count cannot do it across nodes: a node whose workers
    failed counts a restart, a healthy node restarted because the membership changed (a node
    lost or joining) does not, and one that comes back starts from 0.

    On the node of rank 0, the workers' store address is written again under the new round's
    keys. torch 2.13 writes it only in the first round this node is rank 0 of (it keeps the
    shared store from then on), so a node that joins a later round (one that comes back after
    a failure) waited for it until its timeout (tests/launch/test_multinode.py)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        info = original(self)
        os.environ[ROUND_ENV] = str(self._state_holder.state.round)
        bootstrap = info.bootstrap_store_info
        if info.rank == 0 and bootstrap is not None:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, bootstrap.master_addr.encode())
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY,
                           str(bootstrap.master_port).encode())
        return info

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous
    try:
        yield
    finally:
        DynamicRendezvousHandler.next_rendezvous = original


def max_nodes(args: argparse.Namespace) -> int:
    """The most nodes ``--nnodes`` (N or MIN:MAX) allows."""
    from torch.distributed.run import parse_min_max_nnodes

    return parse_min_max_nnodes(args.nnodes)[1]
