"""The ``ps`` layout behind the Trainer: ``layout="ps=S,dp=W"`` runs S + W processes.

The first W processes are the workers: an ordinary data-parallel job of W ranks (their own
process group and mesh, data sharded over them, no DDP), whose optimizer is a
:class:`ServerOptimizer`: its ``step`` pushes the worker's gradients to the servers and copies
back the parameters they return (:class:`~meshtrain.parallel.ps.client.PSClient`). The last S
processes are the parameter servers (:func:`~meshtrain.parallel.ps.server.serve`): they
join no process group, only the RPC world of all S + W processes, hold the parameters and run
the optimizer (Li et al., OSDI 2014). Worker 0 gives them the initial parameters and an
optimizer of the user's class and hyperparameters; the workers' learning-rate scheduler still
runs on the workers and sends each step's rate with the push.

Checkpoints are those of plain data parallelism: before a save the workers copy the servers'
parameters and optimizer state into their model and a local optimizer of the same class (which
never steps), and DCP saves that; after a load worker 0 sends the loaded state to the servers.
So a ``ps`` checkpoint resumes under ``dp`` and back.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist
from torch.distributed import rpc

from meshtrain.errors import ConfigError
from meshtrain.parallel.ps import server as ps
from meshtrain.parallel.ps.client import PSClient, to_index_keyed



def check_ps_layout(layout, settings: dict) -> None:
    """Before any process starts: what a ``ps`` layout cannot do (yet), with the fix."""
    mode, staleness = settings["ps_mode"], settings["ps_staleness"]
    if not layout.num_servers:
        raise ConfigError(f"ps_mode={mode!r}, ps_staleness={staleness!r} are parameter-server "
                          f"settings, but the layout {layout} has no servers; write e.g. "
                          "layout='ps=1,dp=2' (3 processes), or drop them")
    ps.check_ps_settings(layout.num_servers, layout.world_size, mode, staleness)
    refused = {
        "grad_clip_norm": (settings["grad_clip_norm"] is not None,
                           "the global gradient norm is only known on the servers"),
        "log_grad_norm": (settings["log_grad_norm"],
                          "the global gradient norm is only known on the servers"),
        "precision": (settings["precision"] != "fp32", "the servers step in fp32 only (yet)"),
        "local_sgd_every": (settings["local_sgd_every"] is not None,
                            "local SGD averages parameters among workers, without servers"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ConfigError(f"{name}={settings[name]!r} does not work with the layout {layout}: "
                              f"{why}; drop {name}, or use layout='dp=N' (all-reduce)")


def check_ps_model(model: torch.nn.Module, num_servers: int, max_imbalance: float = 2.0) -> None:
    """Whole parameters go to servers (:func:`~meshtrain.parallel.ps.server.plan_shards`):
    refuse a server count that leaves a server empty, or gives one more than ``max_imbalance``
    times its fair share (the largest tensor then sets the step time; more servers don't help)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    sizes = {n: math.prod(s) for n, s in shapes.items()}

    def worst(servers: int) -> float:
        loads = [0] * servers
        for name, server in ps.plan_shards(shapes, servers).items():
            loads[server] += sizes[name]
        return max(loads) * servers / sum(sizes.values())

    if num_servers <= 1:
        return
    best = max(s for s in range(1, min(num_servers, len(shapes)) + 1) if worst(s) <= max_imbalance)
    if num_servers > len(shapes):
        raise ConfigError(f"ps={num_servers} for {len(shapes)} parameter tensors: a server would "
                          f"hold nothing (parameters are not split); use ps={best} (or fewer)")
    if worst(num_servers) > max_imbalance:
        raise ConfigError(
            f"ps={num_servers}: parameters are not split, so one server holds the largest "
            f"tensors, {worst(num_servers):.1f}x its fair share of the {sum(sizes.values())} "
            f"elements (limit {max_imbalance}x), and more servers would not make a step faster; "
            f"use ps={best} (or fewer)")


def serve_job(index: int, rank: int, num_processes: int, store) -> dict:
    """Be server ``ps{index}`` until the workers shut the RPC world down; return what
    :func:`~meshtrain.parallel.ps.server.serve` returns (``final``: the full model)."""
    return ps.serve(index, rank, num_processes, store)


class ServerOptimizerFactory:
    """What a server builds its optimizer with (picklable): the worker optimizer's class and
    each of its parameter groups' hyperparameters, and the group of each parameter by name.
    A server keeps every group, empty where it holds none of the group's parameters, so that
    its group ``i`` is the worker's group ``i`` (a learning rate per group, checkpoints)."""

    def __init__(self, cls, groups: list[dict], group_of: dict[str, int]):
        self.cls, self.groups, self.group_of = cls, groups, group_of

    def named(self, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
        taken = inspect.signature(self.cls.__init__).parameters
        first = self.groups[0]
        optimizer = self.cls([{"params": [p for n, p in params.items() if self.group_of[n] == i]}
                              for i in range(len(self.groups))],
                             **{k: v for k, v in first.items() if k in taken})
        for group, hyper in zip(optimizer.param_groups, self.groups):
            group.update(hyper)  # every one set on the group (e.g. decoupled_weight_decay)
        return optimizer


class ServerOptimizer(torch.optim.Optimizer):
    """A worker's optimizer under ``ps``: ``step()`` pushes the gradients to the servers, which
    run ``local``'s class with each of its parameter groups' hyperparameters, and copies back
    their parameters.

    ``param_groups`` (what a scheduler changes: each group's learning rate goes with every
    push) and ``state`` are ``local``'s; ``local`` itself never steps: it receives the servers'
    state for checkpoints (:meth:`fetch`)."""

    def __init__(self, local: torch.optim.Optimizer, model: torch.nn.Module, client: PSClient):
        super().__init__(local.param_groups, local.defaults)
        self.param_groups, self.state = local.param_groups, local.state
        self.local, self.model, self.client = local, model, client
        self.open = True
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in local.param_groups]
        self.names = [n for group in groups for n in group]  # the state dict's index order
        client.groups = groups

    def server_factory(self) -> ServerOptimizerFactory:
        """What the servers build their optimizer with."""
        return ServerOptimizerFactory(
            type(self.local), [{k: v for k, v in g.items() if k != "params"}
                               for g in self.local.param_groups],
            {n: i for i, group in enumerate(self.client.groups) for n in group})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("an optimizer closure (LBFGS) cannot run on parameter servers")
        # each group's rate as the scheduler left it; zero_grad() clears the gradients
        self.client.step(lr=[g["lr"] for g in self.param_groups], zero_grad=False)

    def fetch(self) -> None:
        """Copy the servers' parameters into the model and their optimizer state into
        ``local`` (before a checkpoint is written; after :meth:`close`, what it last held)."""
        if not self.open:
            return
        state = self.client.state_dict()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state["model"][name])
        self.local.load_state_dict(to_index_keyed(state["optimizer"], self.names))

    def restore(self) -> None:
        """(Every worker, after a checkpoint was loaded into the model and ``local``.) Worker 0
        sends it to the servers; then every worker copies the servers' parameters back."""
        if dist.get_rank() == 0:
            sd = self.local.state_dict()
            params = dict(self.model.named_parameters())
            self.client.load_state_dict({
                "model": {n: params[n].detach() for n in self.names},
                "optimizer": {"state": {self.names[i]: s for i, s in sd["state"].items()},
                              "param_groups": [dict(g, params=names) for g, names
                                               in zip(sd["param_groups"], self.client.groups)]}})
        dist.barrier()
        self.client.pull()

    def close(self) -> None:
        """(Every worker, when training ends.) Take the final parameters and optimizer state,
        give worker 0's copy to the servers (so their processes end with the trained model),
        and leave the RPC world; later checkpoints hold what :meth:`fetch` took last."""
        if not self.open:
            return
        self.fetch()
        self.client.close()
        if dist.get_rank() == 0:
            final = {n: p.detach().clone() for n, p in self.model.state_dict().items()}
            for server in self.client.servers:
                rpc.rpc_sync(server, ps._rpc_keep_final, args=(final,))
        self.open = False
        rpc.shutdown()

    # as the Engine's averager (engine.after_optimizer_step / end_of_training): nothing after a
    # step (the push did it all), close when training ends
    def after_step(self, step: int) -> None:
        pass

    finish = close


def join_workers(store, rank: int, num_processes: int) -> None:
    """Join the RPC world as ``worker{rank}`` (call on every worker after its process group)."""
    ps.join_as_worker(rank, rank, num_processes, store)


def start_servers(model: torch.nn.Module, local: torch.optim.Optimizer, layout, settings: dict,
                  ) -> ServerOptimizer:
    """(Every worker.) The PS client and optimizer; worker 0 initialises the servers, then every
    worker copies their parameters in (so all start from worker 0's)."""
    client = PSClient(model, [ps.server_name(i) for i in range(layout.num_servers)],
                      worker=dist.get_rank() if dist.is_initialized() else 0,
                      num_workers=layout.world_size, mode=settings["ps_mode"],
                      staleness=settings["ps_staleness"])
    optimizer = ServerOptimizer(local, model, client)
    if client.worker == 0:
        client.init_servers(optimizer.server_factory())
    client.pull()
    return optimizer
