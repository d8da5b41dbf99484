"""Parameter-server (PS) training over ``torch.distributed.rpc`` (TensorPipe), beside all-reduce.

The parameter server of Li et al., OSDI 2014 ("Scaling distributed machine learning with the
parameter server"): whole parameters are assigned to server processes (``ps0``, ``ps1``, ...;
:func:`plan_shards`), each holding its shard in fp32 with its own optimizer. Worker processes
(``worker0``, ...) run forward/backward on their own data, push their gradients to the servers
(:meth:`PSClient.step`, no all-reduce among workers) and copy back the parameters the servers
return. Two consistency models:

* ``"sync"``, bulk-synchronous: a server waits for every worker's gradients of a step, averages
  them (sum / W) and steps its optimizer once. With equal local batch sizes the mean of the
  workers' mean gradients is the global-batch mean gradient: training equals one process on the
  global batch (up to float summation order).
* ``"async"``, Hogwild-like with the stale-synchronous-parallel bound of Ho et al., NIPS 2013
  ("More effective distributed ML via a stale synchronous parallel parameter server"): each push
  is applied on arrival as one worker's mean gradient (W times the optimizer steps of sync, each
  on 1/W of the data). A worker's clock counts its pushes; a worker at clock c may not start
  step c before the slowest worker's clock reaches c - s (``staleness=s``), so every gradient is
  computed from parameters holding all updates of every worker up to s clocks back.
  ``staleness=None`` drops the bound. That bound is all async guarantees: results depend on the
  arrival order and are not equal to one process.

Roles: :func:`serve` makes a process a server (it answers RPCs until every process has called
``rpc.shutdown``); :func:`join_as_worker` a worker, which drives a ``PSClient``
(meshtrain/parallel/ps/client.py). Worker 0 initialises the servers (``init_servers``: its
initial parameters and a picklable optimizer factory); every worker then calls ``pull`` (which
waits for that). A process hosts at most one server (a module-level registry that the RPC
functions reach).
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Callable
from urllib.parse import urlparse

import torch
from torch.distributed import rpc

from meshtrain.errors import ConfigError

MODES = ("sync", "async")
OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def server_name(index: int) -> str:
    return f"ps{index}"  # RPC names; a worker's is f"worker{index}"


def plan_shards(named_shapes: dict[str, tuple], num_servers: int) -> dict[str, int]:
    """{parameter name: server index}: whole parameters, largest first, each to the server
    holding the fewest elements so far (lowest index on ties). Deterministic."""
    if num_servers < 1:
        raise ConfigError(f"num_servers must be at least 1, got {num_servers}")
    sizes = {name: math.prod(tuple(shape)) for name, shape in named_shapes.items()}
    loads, owner = [0] * num_servers, {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: ties keep the given order
        server = min(range(num_servers), key=loads.__getitem__)
        owner[name] = server
        loads[server] += sizes[name]
    return {name: owner[name] for name in named_shapes}


def check_ps_settings(num_servers: int, num_workers: int, mode: str,
                      staleness: int | None = None, num_params: int | None = None) -> None:
    """Raise ``ConfigError`` (what is wrong and how to fix it) for settings a PS job can't run."""
    if mode not in MODES:
        raise ConfigError(f"parameter-server mode {mode!r} is not one of {MODES}: use 'sync' "
                          "(bulk-synchronous, equal to one process) or 'async' (bounded staleness)")
    if num_workers < 1:
        raise ConfigError(f"a parameter-server job needs at least 1 worker, got {num_workers}: "
                          "start more processes than servers (world size = servers + workers) "
                          "or lower num_servers")
    if num_servers < 1:
        raise ConfigError(f"a parameter-server job needs at least 1 server, got {num_servers}: "
                          "set num_servers >= 1 (or use all-reduce data parallelism instead)")
    if num_params is not None and num_servers > num_params:
        raise ConfigError(f"{num_servers} parameter servers for {num_params} parameters: a server "
                          f"would hold nothing (parameters are not split); use at most "
                          f"{num_params} servers")
    if staleness is not None:
        if not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"staleness must be an integer >= 0 (steps a worker may run ahead "
                              f"of the slowest), got {staleness!r}; use None for no bound")
        if mode == "sync" and staleness:
            raise ConfigError(f"staleness={staleness} applies to mode='async' only: sync workers "
                              "step in lockstep; drop staleness or use mode='async'")


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)


def master(tensor: torch.Tensor) -> torch.Tensor:
    """A server's copy's dtype: at least float32 (bf16/fp16 gradients), float64 kept."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class ParameterServer:
    """One server's shard: fp32 parameters (float64 for a float64 model) by full name, an optimizer over them, version counter
    (optimizer steps taken), the workers' clocks (async) and byte counters."""

    def __init__(self, params: dict[str, torch.Tensor], optimizer_factory: OptimizerFactory,
                 num_workers: int, mode: str = "sync", staleness: int | None = None):
        check_ps_settings(1, num_workers, mode, staleness, None)
        self.params = {n: master(t.detach()).clone().requires_grad_(True)
                       for n, t in params.items()}
        # a factory that places parameters in groups by name (the Trainer's:
        # ps/layout.py ServerOptimizerFactory) has ``named``; else it takes the tensors
        named = getattr(optimizer_factory, "named", None)
        self.optimizer = (named(self.params) if named is not None
                          else optimizer_factory(list(self.params.values())))
        self.num_workers, self.mode, self.staleness = num_workers, mode, staleness
        self.lock = threading.Lock()
        self.version = 0
        self.rounds: dict[int, dict[int, tuple]] = {}  # sync: step -> {worker: (grads, lr, fut)}
        self.clocks = [0] * num_workers  # pushes per worker
        self.finished: set[int] = set()
        self.waiting: list[tuple[int, torch.futures.Future]] = []  # async: workers held back
        self.read_clock = [0] * num_workers  # slowest clock when each worker last read
        self.read_version = [0] * num_workers
        self.bytes_received = self.bytes_sent = 0
        self.max_staleness = 0  # clocks between a gradient's read and its worker's clock (<= s)
        self.max_missed_updates = 0  # other pushes applied between a read and its push

    # ---- RPC-facing ----
    def push(self, worker: int, step: int, grads: dict, lr: float | None) -> torch.futures.Future:
        """Gradients of ``worker``'s ``step``; the future answers (params, version) once the
        worker may go on (sync: after the step all workers pushed; async: SSP bound)."""
        fut = torch.futures.Future()
        with self.lock:
            self.bytes_received += _nbytes(grads)
            push = self._push_sync if self.mode == "sync" else self._push_async
            replies = push(worker, step, grads, lr, fut)
        _answer(replies)
        return fut

    def pull(self, worker: int) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self.lock:
            self.waiting.append((worker, fut))
            replies = self._release()
        _answer(replies)
        return fut

    def finish(self, worker: int) -> None:
        """``worker`` pushes no more: it no longer holds the others back (async)."""
        with self.lock:
            self.finished.add(worker)
            replies = self._release()
        _answer(replies)

    def state(self) -> dict:
        """params {name: fp32}, optimizer {name: torch's per-parameter state}, param_groups
        (hyperparameters without "params"), version."""
        with self.lock:
            sd = self.optimizer.state_dict()
            names = self._index_names()
            return {
                "params": {n: p.detach().clone() for n, p in self.params.items()},
                "optimizer": {names[i]: copy.deepcopy(s) for i, s in sd["state"].items()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in sd["param_groups"]],
                "version": self.version,
            }

    def load_state(self, params: dict, optimizer_state: dict | None = None,
                   param_groups: list[dict] | None = None) -> None:
        """Put back what :meth:`state` returned (from a checkpoint): parameters by name, and
        optimizer state by name (entries of names this server doesn't hold are ignored)."""
        with self.lock, torch.no_grad():
            for name, value in params.items():
                if name in self.params:
                    self.params[name].copy_(value)
            if optimizer_state is None:
                return
            sd = self.optimizer.state_dict()
            sd["state"] = {i: optimizer_state[n] for i, n in enumerate(self._index_names())
                           if n in optimizer_state}
            for group, hyper in zip(sd["param_groups"], param_groups or ()):
                group.update({k: v for k, v in hyper.items() if k != "params"})
            self.optimizer.load_state_dict(sd)

    def stats(self) -> dict:
        with self.lock:
            return {"bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                    "version": self.version, "max_staleness": self.max_staleness,
                    "max_missed_updates": self.max_missed_updates,
                    "num_params": len(self.params)}

    # ---- internals (lock held) ----
    def _index_names(self) -> list[str]:
        """Parameter names in the order of the optimizer's state-dict indices."""
        by_id = {id(p): n for n, p in self.params.items()}
        return [by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def _apply(self, grads: dict[str, torch.Tensor | None], lr: float | None) -> None:
        for name, p in self.params.items():
            p.grad = grads.get(name)
        if lr is not None:
            lrs = lr if isinstance(lr, list) else [lr] * len(self.optimizer.param_groups)
            for group, value in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = value
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def _read(self, worker: int) -> tuple[dict, int]:
        self.read_clock[worker] = self._slowest()
        self.read_version[worker] = self.version
        params = {n: p.detach().clone() for n, p in self.params.items()}
        self.bytes_sent += _nbytes(params)
        return params, self.version

    def _slowest(self) -> float:
        live = [c for w, c in enumerate(self.clocks) if w not in self.finished]
        return min(live) if live else math.inf

    def _push_sync(self, worker, step, grads, lr, fut):
        round_ = self.rounds.setdefault(step, {})
        if worker in round_:
            return [(fut, RuntimeError(f"worker {worker} pushed step {step} twice"))]
        round_[worker] = (grads, lr, fut)
        if len(round_) < self.num_workers:
            return []
        del self.rounds[step]
        ordered = [round_[w] for w in sorted(round_)]  # fixed summation order: deterministic
        parts = {n: [master(g[n]) for g, _, _ in ordered if g.get(n) is not None]
                 for n in self.params}  # a name no worker has a gradient for stays None
        self._apply({n: sum(ps) / self.num_workers for n, ps in parts.items() if ps},
                    ordered[0][1])
        self.clocks = [c + 1 for c in self.clocks]
        return [(f, self._read(w)) for w, (_, _, f) in sorted(round_.items())]

    def _push_async(self, worker, step, grads, lr, fut):
        clock = self.clocks[worker]
        self.max_staleness = max(self.max_staleness, clock - self.read_clock[worker])
        self.max_missed_updates = max(self.max_missed_updates,
                                      self.version - self.read_version[worker])
        self._apply({n: master(g) for n, g in grads.items()}, lr)
        self.clocks[worker] = clock + 1
        self.waiting.append((worker, fut))
        return self._release()

    def _release(self) -> list:
        """Answer the waiting workers that the SSP rule lets go on: clock - s <= slowest."""
        slowest, waiting, self.waiting, replies = self._slowest(), self.waiting, [], []
        for worker, fut in waiting:
            if self.staleness is None or self.clocks[worker] - self.staleness <= slowest:
                replies.append((fut, self._read(worker)))
            else:
                self.waiting.append((worker, fut))
        return replies


def _answer(replies) -> None:
    for fut, value in replies:  # outside the lock: completing a future sends the reply
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)


# ---- the server process's registry and the functions workers call over RPC ----
_HOST: dict = {"server": None, "early_pulls": []}
_HOST_LOCK = threading.Lock()


def _server() -> ParameterServer:
    server = _HOST["server"]
    if server is None:
        raise RuntimeError("this parameter server was not initialised: worker 0 must call "
                           "PSClient.init_servers first")
    return server


def _rpc_init(params, optimizer_factory, num_workers, mode, staleness) -> None:
    with _HOST_LOCK:
        if _HOST["server"] is not None:
            raise RuntimeError("this parameter server was initialised twice")
        server = _HOST["server"] = ParameterServer(params, optimizer_factory, num_workers, mode,
                                                   staleness)
        early, _HOST["early_pulls"] = _HOST["early_pulls"], []
    for worker, fut in early:  # pulls that came before the parameters
        server.pull(worker).add_done_callback(lambda inner, out=fut: out.set_result(inner.wait()))


@rpc.functions.async_execution
def _rpc_pull(worker: int) -> torch.futures.Future:
    with _HOST_LOCK:
        if _HOST["server"] is None:
            fut = torch.futures.Future()
            _HOST["early_pulls"].append((worker, fut))
            return fut
    return _server().pull(worker)


@rpc.functions.async_execution
def _rpc_push(worker, step, grads, lr) -> torch.futures.Future:
    return _server().push(worker, step, grads, lr)


def _rpc_keep_final(state: dict) -> None:
    """The trained model's full state, which :func:`serve` returns (ps/layout.py)."""
    _HOST["final"] = state


def _rpc_call(method: str, *args):
    """finish / state / load_state / stats of this process's server."""
    return getattr(_server(), method)(*args)


# ---- process roles ----
def rpc_options(init_method: str, *, num_threads: int = 16,
                rpc_timeout: float = 120.0) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options for a job rendezvousing at ``init_method`` (:func:`_on_job_store`).
    ``rpc_timeout`` bounds one call, a sync push included (it waits for the slowest worker)."""
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                           num_worker_threads=max(8, num_threads),
                                           rpc_timeout=rpc_timeout)


# init_rpc meets over the job's own store (no second store listening on a port of its own):
# a rendezvous scheme whose URL names a store lent for the duration of init_rpc.
_SCHEME = "meshtrain-job-store"
_LENT: dict[str, object] = {}


def _job_store_rendezvous(url: str, **kwargs):
    import torch.distributed as dist

    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if pair)
    yield dist.PrefixStore("rpc", _LENT[parsed.netloc]), int(query["rank"]), int(
        query["world_size"])
    raise RuntimeError("the RPC world cannot rendezvous again")


@contextlib.contextmanager
def _on_job_store(store):
    """An ``init_method`` URL for ``init_rpc`` that rendezvous over ``store`` (the job's,
    which listens where the launcher or meshtrain/launch/network.py put it)."""
    from torch.distributed.rendezvous import register_rendezvous_handler

    with contextlib.suppress(RuntimeError):  # registered once per process
        register_rendezvous_handler(_SCHEME, _job_store_rendezvous)
    key = f"store{id(store)}"
    _LENT[key] = store
    try:
        yield f"{_SCHEME}://{key}"
    finally:
        _LENT.pop(key, None)


def ps_role(rank: int, num_servers: int) -> tuple[str, int]:
    """Ranks 0..S-1 are servers ps0..; the rest workers worker0..: ("server"|"worker", index)."""
    return ("server", rank) if rank < num_servers else ("worker", rank - num_servers)


def serve(index: int, rank: int, world_size: int, store, **options) -> dict:
    """Be server ``ps{index}`` until every process has called ``rpc.shutdown``; return what it
    held at the end: {"name", "state" (see ParameterServer.state), "stats"} (None if unused)."""
    with _on_job_store(store) as init_method:
        rpc.init_rpc(server_name(index), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_options(init_method, **options))
    rpc.shutdown()  # graceful: waits for all workers' outstanding calls and their shutdown
    with _HOST_LOCK:
        server, _HOST["server"] = _HOST["server"], None
        final = _HOST.pop("final", None)
    return {"name": server_name(index), "state": server and server.state(),
            "stats": server and server.stats(), "final": final}


def join_as_worker(index: int, rank: int, world_size: int, store, **options) -> None:
    """Join the job as ``worker{index}``; end with ``rpc.shutdown()`` after the last step."""
    with _on_job_store(store) as init_method:
        rpc.init_rpc(f"worker{index}", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_options(init_method, **options))
