"""The worker side of parameter-server training (meshtrain/parallel/ps/server.py):
:class:`PSClient` pushes a worker's gradients to the servers that hold them and copies back the
parameters they return; it also gathers and restores the servers' state for checkpoints."""

from __future__ import annotations

import torch
from torch.distributed import rpc

from meshtrain.errors import ConfigError
from meshtrain.parallel.ps.server import (
    OptimizerFactory, _nbytes, _rpc_call, _rpc_init, _rpc_pull, _rpc_push, check_ps_settings,
    master, plan_shards,
)


class PSClient:
    """A worker's side: pushes its gradients to the servers, copies back their parameters.

    ``servers`` are RPC names (``ps0``...); ``assignment`` {name: server index} defaults to
    :func:`plan_shards`. Every worker must run the same number of steps (or :meth:`close`
    when it stops early, so that async workers aren't held back by it)."""

    def __init__(self, model: torch.nn.Module, servers: list[str], *, worker: int,
                 num_workers: int, mode: str = "sync", staleness: int | None = None,
                 assignment: dict[str, int] | None = None):
        self.params = dict(model.named_parameters())
        check_ps_settings(len(servers), num_workers, mode, staleness, len(self.params))
        if assignment is None:
            assignment = plan_shards({n: tuple(p.shape) for n, p in self.params.items()},
                                     len(servers))
        wrong = sorted(set(self.params) ^ {n for n, s in assignment.items()
                                           if 0 <= s < len(servers)})
        if wrong:
            raise ConfigError(f"the shard assignment misses, or names unknown or out-of-range "
                              f"entries for, {wrong}: give every parameter a server in "
                              f"0..{len(servers) - 1}")
        self.model, self.servers, self.assignment = model, list(servers), dict(assignment)
        self.worker, self.num_workers = worker, num_workers
        self.mode, self.staleness = mode, staleness
        self.shards = [[n for n in self.params if assignment[n] == i] for i in range(len(servers))]
        self.step_count = self.bytes_sent = self.bytes_received = self.bytes_per_step = 0
        self.versions = [0] * len(servers)  # of each server's parameters last copied in
        self.groups = [list(self.params)]  # the optimizer's parameter groups, by name

    def init_servers(self, optimizer_factory: OptimizerFactory) -> None:
        """(Worker 0, once.) Give each server its parameters and the optimizer factory."""
        self._wait([rpc.rpc_async(s, _rpc_init, args=(
            {n: master(self.params[n].detach()).clone() for n in shard}, optimizer_factory,
            self.num_workers, self.mode, self.staleness))
            for s, shard in zip(self.servers, self.shards)])

    def pull(self) -> None:
        """Copy the servers' parameters into the model (waits for init_servers)."""
        self._copy_in(self._wait([rpc.rpc_async(s, _rpc_pull, args=(self.worker,))
                                  for s in self.servers]))

    def step(self, lr: float | None = None, zero_grad: bool = True) -> None:
        """Push this worker's gradients (to all servers at once), wait for the updated
        parameters, copy them in and clear the gradients (unless ``zero_grad=False``: the
        caller does). ``lr`` overrides the servers' learning rate for this update (a
        worker-side LR schedule): one for every group, or a list, one per group."""
        futs, sent = [], 0
        for server, shard in zip(self.servers, self.shards):
            grads = {n: self.params[n].grad.detach().cpu() for n in shard  # RPC sends CPU
                     if self.params[n].grad is not None}
            sent += _nbytes(grads)
            futs.append(rpc.rpc_async(server, _rpc_push,
                                      args=(self.worker, self.step_count, grads, lr)))
        received = self._copy_in(self._wait(futs))
        if zero_grad:
            self.model.zero_grad(set_to_none=True)
        self.step_count += 1
        self.bytes_sent += sent
        self.bytes_per_step = sent + received

    def close(self) -> None:
        """This worker pushes no more (call before rpc.shutdown)."""
        self._call("finish", self.worker)

    # ---- checkpoints ----
    def gather(self) -> list[dict]:
        """Every server's :meth:`ParameterServer.state`."""
        return self._call("state")

    def state_dict(self) -> dict:
        """{"model": {name: fp32 param}, "optimizer": full-model optimizer state}, the latter
        in ``get_state_dict``'s format: {"state": {name: {...}}, "param_groups": [{...,
        "params": [names]}]}, a group per :attr:`groups` (hyperparameters of server 0)."""
        states = self.gather()
        params, optim = {}, {}
        for state in states:
            params.update(state["params"])
            optim.update(state["optimizer"])
        names = list(self.params)
        return {"model": {n: params[n] for n in names},
                "optimizer": {"state": {n: optim[n] for n in names if n in optim},
                              "param_groups": [dict(hyper, params=group) for hyper, group
                                               in zip(states[0]["param_groups"], self.groups)]}}

    def load_state_dict(self, state: dict) -> None:
        """Send a :meth:`state_dict` (or DCP-loaded equivalent) back to the servers and into
        this worker's model; the other workers then :meth:`pull`."""
        model, optim = state["model"], state.get("optimizer")
        groups = optim["param_groups"] if optim else None
        self._wait([rpc.rpc_async(s, _rpc_call, args=(
            "load_state", {n: model[n] for n in shard},
            None if optim is None else {n: optim["state"][n] for n in shard if n in optim["state"]},
            groups)) for s, shard in zip(self.servers, self.shards)])
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(model[name])

    def server_stats(self) -> list[dict]:
        return self._call("stats")

    # ---- internals ----
    @staticmethod
    def _wait(futs: list) -> list:
        return [f.wait() for f in futs]

    def _call(self, method: str, *args) -> list:
        return self._wait([rpc.rpc_async(s, _rpc_call, args=(method, *args))
                           for s in self.servers])

    @torch.no_grad()
    def _copy_in(self, replies: list[tuple[dict, int]]) -> int:
        received = 0
        for i, (params, version) in enumerate(replies):
            for name, value in params.items():
                self.params[name].copy_(value)
            received += _nbytes(params)
            self.versions[i] = version
        self.bytes_received += received
        return received


def to_index_keyed(optimizer_state: dict, names: list[str]) -> dict:
    """A name-keyed optimizer state dict (:meth:`PSClient.state_dict`'s) in the index-keyed
    format of ``torch.optim.Optimizer.state_dict()`` for an optimizer over ``names`` in order."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in optimizer_state["state"].items()},
            "param_groups": [dict(g, params=[index[n] for n in g["params"]])
                             for g in optimizer_state["param_groups"]]}
