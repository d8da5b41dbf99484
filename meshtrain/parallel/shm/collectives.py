"""A mesh axis's all-reduce, all-gather and reduce-scatter through shared memory (CPU processes of
one host): the process group meshtrain gives the ``tp`` axis under ``local_comm="auto"``.

Why: tensor parallelism issues a collective per matrix multiply or two, each of one activation,
on the training thread; gloo's cost 0.4-0.5 ms each here (a thread hand-off and a loopback TCP
round, and its reduce-scatter moves an all-reduce's bytes), the same exchanges through shared
memory a fraction of that (``benchmarks/README.md``, tensor_parallel.py). DTensor issues them as
torch's functional collectives, which look a group up by its registered name and call its
methods, so the group itself has to be the fast one: :class:`SharedMemoryCollectives` is a
process-group backend ("meshtrain_shm", ``init_device_mesh(..., backend_override=...)``) built
on :class:`~meshtrain.parallel.shm.p2p.LocalP2PGroup`'s sends and receives.

What goes through shared memory: ``all_reduce``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (sum, average, max, min, product), functional or not, and the same
two on any dim (:meth:`~SharedMemoryCollectives.all_gather_on`,
:meth:`~SharedMemoryCollectives.reduce_scatter_on`: sequence parallel's,
``sequence_parallel.py``). Everything else the axis is asked for (broadcast, scatter, barrier,
object collectives, all-to-all) goes to a gloo group over the same ranks that this group
holds. Each collective is done when it returns (a send is one copy into the peer's ring and
never waits; a receive waits for its message), on the calling thread. Every rank gets the same
bits: with 2 ranks both combine the same two tensors, with more each chunk is reduced on one
rank and then gathered.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.parallel.shm.p2p import LocalP2PGroup

BACKEND = "meshtrain_shm"
# what is delegated to the gloo group as it is (the arguments c10d passes a backend)
_GLOO = ("broadcast", "allgather", "allgather_coalesced", "allreduce_coalesced", "alltoall",
         "alltoall_base", "barrier", "gather", "reduce", "reduce_scatter", "scatter",
         "monitored_barrier", "recv_anysource")


class _Done(dist.Work):
    """A collective done when it returned; its future holds its output tensors, as gloo's."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self.outputs)
        return future


class SharedMemoryCollectives(LocalP2PGroup):
    """All-reduce, all-gather and reduce-scatter through shared memory, the rest through gloo
    (see the module). Made by ``new_group(ranks, backend="meshtrain_shm")``."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(dist.PrefixStore("shm/", store), rank, size, timeout)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)

    @property
    def group_name(self) -> str:
        # a Python group has no C++ backend to carry its name: the name c10d registered it under
        return dist.distributed_c10d._world.pg_names[self]

    def getBackendName(self) -> str:
        return BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._gloo._set_default_timeout(timeout)

    # -- in shared memory --------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        reduction = _reduction(opts, tensors)
        if reduction is None:
            return self._gloo.allreduce(tensors, opts)
        for tensor in tensors:
            self._all_reduce(tensor, *reduction)
        return _Done(tensors)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self.all_gather_on(out.view(-1) if out.is_contiguous() else out, inp.reshape(-1)
                               if out.is_contiguous() else inp, 0)
        return _Done(outputs)

    def all_gather_single(self, output, inp, opts=None):
        return self.allgather_into_tensor_coalesced([output], [inp], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        reduction = _reduction(opts, inputs)
        for out, inp in zip(outputs, inputs):
            if reduction is None:  # what shared memory does not take: gloo's all-reduce of a
                whole = inp.clone()  # copy, then this rank's part
                self._gloo.allreduce([whole], _allreduce_options(opts)).wait()
                out.copy_(whole.view(-1).chunk(self.size())[self.rank()].view_as(out))
            else:
                combine, average = reduction
                self.reduce_scatter_on(out.view(-1) if out.is_contiguous() else out,
                                       inp.reshape(-1) if out.is_contiguous() else inp, 0,
                                       combine=combine, average=average)
        return _Done(outputs)

    def reduce_scatter_single(self, output, inp, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [inp], opts)

    # the names c10d calls them by: from Python (torch 2.13) and through its dispatcher
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, *args):
        """gloo's ``alltoall_base`` over the same ranks."""
        return self._gloo.alltoall_base(*args)

    def _peers(self) -> list[int]:
        return [r for r in range(self.size()) if r != self.rank()]

    # -- on any dim (sequence parallel: meshtrain/parallel/tensor/sequence_parallel.py) ----------------
    def all_gather_on(self, out: torch.Tensor, inp: torch.Tensor, dim: int) -> None:
        """``out``'s chunks on ``dim`` become every rank's ``inp`` (rank order), each received
        straight into its place (a strided view on a dim other than the first)."""
        chunks = out.chunk(self.size(), dim)
        for r in self._peers():  # every send first: a send never waits for its receiver
            self.send([inp], r, 0)
        chunks[self.rank()].copy_(inp)
        for r in self._peers():
            self.recv([chunks[r]], r, 0).wait()

    def reduce_scatter_on(self, out: torch.Tensor, inp: torch.Tensor, dim: int, *,
                          combine: str = "sum", average: bool = False) -> None:
        """``out`` becomes this rank's chunk on ``dim`` of the sum (or mean, max, min,
        product) of every rank's ``inp``: the other chunks sent straight from their place, the
        peers' parts of this one combined where they lie in shared memory."""
        parts = inp.chunk(self.size(), dim)
        for r in self._peers():
            self.send([parts[r]], r, 0)
        out.copy_(parts[self.rank()])
        for r in self._peers():
            self.recv([out], r, 0, reduce=_into(out, combine)).wait()
        if average:
            out.div_(self.size())

    def _all_reduce(self, tensor: torch.Tensor, combine: str, average: bool) -> None:
        n, me = self.size(), self.rank()
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        if n == 2:  # one exchange: both ranks combine the same two tensors (a + b == b + a)
            peer = 1 - me
            self.send([flat], peer, 0)
            self.recv([flat], peer, 0, reduce=_into(flat, combine)).wait()
        else:  # each rank reduces one chunk (reduce-scatter), then every chunk goes to all
            parts = flat.tensor_split(n)
            for r in self._peers():
                self.send([parts[r]], r, 0)
            for r in self._peers():
                self.recv([parts[me]], r, 0, reduce=_into(parts[me], combine)).wait()
            for r in self._peers():
                self.send([parts[me]], r, 0)
            for r in self._peers():
                self.recv([parts[r]], r, 0).wait()
        if average:
            flat.div_(n)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


def _into(out: torch.Tensor, combine: str):
    """``out`` combined in place with a message (where it lies in shared memory)."""
    op = _COMBINE[combine]
    return lambda message: op(out, message, out=out)


def _reduction(opts, tensors) -> tuple[str, bool] | None:
    """(how two values combine, whether the result is divided by the ranks: an average), or
    None for what goes to gloo (another reduction, or tensors shared memory does not take:
    not on the CPU, booleans, an average of integers, max / min of complex numbers)."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    if any(t.device.type != "cpu" or t.dtype == torch.bool for t in tensors):
        return None
    floating = all(t.is_floating_point() or t.is_complex() for t in tensors)
    ordered = not any(t.is_complex() for t in tensors)
    for kind, combine, average, allowed in (
            (dist.ReduceOp.SUM, "sum", False, True), (dist.ReduceOp.AVG, "sum", True, floating),
            (dist.ReduceOp.MAX, "max", False, ordered), (dist.ReduceOp.MIN, "min", False, ordered),
            (dist.ReduceOp.PRODUCT, "product", False, True)):
        if op == kind:
            return (combine, average) if allowed else None
    return None


def _allreduce_options(opts) -> dist.AllreduceOptions:
    out = dist.AllreduceOptions()
    if opts is not None:
        out.reduceOp = opts.reduceOp
    return out


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._gloo, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"gloo's ``{name}`` over the same ranks."
    return method


for _name in _GLOO:
    setattr(SharedMemoryCollectives, _name, _delegate(_name))


def _create(store, rank, size, timeout):
    return SharedMemoryCollectives(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
