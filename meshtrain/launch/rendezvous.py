"""torchrun's c10d rendezvous as `meshtrain run` runs it (launch/torchrun.py): the stores an
agent hosts bound to 127.0.0.1 on one host, several agents of one job on one host, and the
rendezvous round passed to the workers (with the store address torch 2.13 forgets to rewrite)."""

from __future__ import annotations

import argparse
import contextlib
import os

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import ROUND_ENV

LOCAL_HOST = "127.0.0.1"


@contextlib.contextmanager
def loopback_rendezvous_store(args: argparse.Namespace):
    """On one node, the two stores torchrun's agent hosts in this process listen on 127.0.0.1
    only, not on every interface: the rendezvous store's server is started here on a socket
    bound to it (torchrun's ``TCPStore(..., multi_tenant=True)`` on that port reuses it: torch
    keeps one server per port in a process), and the workers' bootstrap store, which the
    rendezvous handler creates on a free port, is made the same way. Several agents of one job
    on this machine (``--nnodes 2`` at 127.0.0.1, e.g. to try a multi-node layout): the first
    to bind the port hosts the rendezvous store, the others join it (as does an agent given
    ``--rdzv-conf is_host=0``)."""
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    if not (args.rdzv_backend == "c10d" and host == LOCAL_HOST and port.isdigit()):
        yield
        return
    hosting = "is_host=0" not in args.rdzv_conf and "is_host=false" not in args.rdzv_conf.lower()
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from meshtrain.launch.network import listening_socket

    def loopback_store(port: int):
        sock = listening_socket(LOCAL_HOST, port)
        return dist.TCPStore(LOCAL_HOST, sock.getsockname()[1], is_master=True,
                             multi_tenant=True, wait_for_workers=False,
                             master_listen_fd=sock.detach())

    try:
        store = loopback_store(int(port)) if hosting else None
    except ConfigError:
        if max_nodes(args) == 1:
            raise
        # several agents on this machine ("nodes" of one job, tests/launch/test_multinode.py):
        # another one hosts the rendezvous store already, and torch joins it as a client
        store = None
    original = DynamicRendezvousHandler._create_tcp_store_server
    DynamicRendezvousHandler._create_tcp_store_server = \
        lambda self, master_addr, master_port: loopback_store(master_port)
    try:
        yield
    finally:
        DynamicRendezvousHandler._create_tcp_store_server = original
        del store




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
