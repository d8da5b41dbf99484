"""FSDP2's collectives made faster on gloo, and explicit prefetch (CPU jobs; NCCL keeps FSDP2's).

FSDP2 gathers a block's parameters before its forward (and, for ZeRO-3, again before its
backward) and reduce-scatters its gradients after its backward. On a GPU the collectives run on
their own streams and overlap the compute; on the CPU there are no streams, so by default every
all-gather and reduce-scatter blocks the training thread, and gloo's own ``all_gather`` and
``reduce_scatter`` are slow. Measured on 2 ranks here (``benchmarks/README.md``, sharding.py):

* **all-gather as broadcasts** (:class:`BroadcastAllGather`): each rank broadcasts its own chunk
  in place in the output: the bytes of a ring all-gather, 2.5-4x faster than gloo's
  ``all_gather`` (8.6 -> 2.6 ms for 4 MiB shards).
* **reduce-scatter as an all-to-all** (:class:`AllToAllReduceScatter`): each rank gets its
  chunk of every rank's flat gradient buffer (``all_to_all_single``) and sums them: the (N-1)/N
  of the buffer a ring moves, where gloo's ``reduce_scatter`` moves an all-reduce's bytes
  (8.5 -> 4.1 ms for a 4 MiB buffer). When FSDP2 would not read the result at once (an
  average, no gradient to accumulate into, no HSDP all-reduce after it, the same dtype), the
  all-to-all is left running while the previous block's backward computes: the sum is done
  when the next block's reduce-scatter starts or when backward ends, so at most one block's
  unsharded gradients wait in flight.
* **explicit prefetch** (:func:`set_prefetch`): each block's forward starts the next block's
  all-gather without waiting for it (``async_op``), and each block's backward the all-gather of
  the block whose backward comes next.

Together (with ``shard_unit_mb``'s grouping) they took zero2 / zero3 from 1.92 / 2.43 to 1.42 /
1.65 x DDP's step time on 2 ranks; what is left is FSDP2's own copies on a CPU-bound machine.

Where the ranks share a host (``local_comm="auto"``, a ``shm.p2p.LocalP2PGroup``), the same two
collectives run on its sends and receives instead of gloo's broadcasts and all-to-all: a send is
one copy into shared memory, a receive one copy out, with no gloo thread or socket between
(:class:`SharedMemoryAllGather`, and the reduce-scatter's ``p2p``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

try:  # FSDP2's comm interface (public methods, private module in torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - an older or newer torch: keep FSDP2's own
    AllGather = ReduceScatter = None
# torch 2.13's name; older ones (the GPU image's 2.11) have reduce_scatter_tensor alone
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllOf(dist.Work):
    """One ``Work`` that waits for several (FSDP2 waits on what its all-gather returns)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


class _InFlight:
    """The one reduce-scatter of a model still running: finished (waited for and summed into
    FSDP2's output) before the next one starts and when backward ends."""

    def __init__(self):
        self.pending = None  # (Work, the function that sums what arrived)
        self.callback_queued = False

    def start(self, work: dist.Work, then) -> None:
        self.finish()
        self.pending = (work, then)
        if not self.callback_queued:  # run once when this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True

    def finish(self) -> None:
        if self.pending is None:
            return
        work, then = self.pending
        self.pending = None
        work.wait()
        then()

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self.finish()


if ReduceScatter is not None:

    class BroadcastAllGather(AllGather):
        """FSDP2's all-gather done as one broadcast per rank of its own chunk, in place in the
        output (FSDP2 puts each rank's input at its offset there)."""

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False):
            chunks = output_tensor.chunk(group.size())
            mine = chunks[group.rank()]
            if mine.data_ptr() != input_tensor.data_ptr():
                mine.copy_(input_tensor)
            works = [dist.broadcast(chunk, group=group, group_src=src, async_op=async_op)
                     for src, chunk in enumerate(chunks)]
            return _AllOf(works) if async_op else None

    class SharedMemoryAllGather(BroadcastAllGather):
        """FSDP2's all-gather as sends of this rank's chunk to every other rank and receives of
        theirs in place in the output, through shared memory (``p2p``: a LocalP2PGroup over
        the same ranks as the FSDP group). The sends are done when it returns; an ``async_op``
        caller's wait copies the others' chunks out as they arrive."""

        def __init__(self, p2p):
            self.p2p = p2p

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False):
            chunks = output_tensor.chunk(group.size())
            rank = group.rank()
            if chunks[rank].data_ptr() != input_tensor.data_ptr():
                chunks[rank].copy_(input_tensor)
            work = _AllOf(_exchange(self.p2p, [chunks[rank]] * len(chunks), chunks, rank))
            if async_op:
                return work
            work.wait()
            return None

    class AllToAllReduceScatter(ReduceScatter):
        """FSDP2's reduce-scatter done as ``all_to_all_single`` plus a local sum (SUM / AVG;
        any other op goes through ``reduce_scatter_single`` as before). With ``in_flight``
        (shared by a model's modules) and ``module`` (the FSDP module whose gradients the
        output becomes), an average is left running when FSDP2 will not read it at once."""

        def __init__(self, in_flight: _InFlight | None = None, module: nn.Module | None = None,
                     p2p=None):
            self.in_flight, self.module, self.p2p = in_flight, module, p2p

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def _can_defer(self, op, output: torch.Tensor) -> bool:
            # FSDP2 reads the output at once to post-divide (op SUM), to cast (another dtype)
            # or to add it to a gradient already there; HSDP's all-reduce reads it too.
            # (and only inside a backward pass, whose end finishes it: a pipeline schedule
            # calls FSDP2's post-backward itself after its last backward)
            return (self.module is not None and self.in_flight is not None
                    and op == dist.ReduceOp.AVG and torch._C._current_graph_task_id() != -1
                    and all(p.grad is None and p.dtype == output.dtype
                            for p in _managed_params(self.module)))

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op, async_op: bool = False):
            average = op == dist.ReduceOp.AVG
            if self.in_flight is not None:
                self.in_flight.finish()  # collectives and sums stay in issue order
            if async_op or not (average or op == dist.ReduceOp.SUM):
                return _REDUCE_SCATTER(output=output_tensor, input=input_tensor,
                                       group=group, op=op, async_op=async_op)
            defer = self._can_defer(op, output_tensor)
            work, then = _reduce_scatter(output_tensor, input_tensor, group, average, defer,
                                         self.p2p)
            if defer:  # the work keeps input_tensor alive until it is waited for
                self.in_flight.start(work, then)
            else:
                then()
            return None

    def _reduce_scatter(output: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup,
                        average: bool, async_op: bool, p2p=None):
        """Start the all-to-all of gradient chunks (through shared memory with ``p2p``); (its
        Work or None, the function that sums what arrived into ``output``)."""
        n = group.size()
        if p2p is not None:
            return _reduce_scatter_shared(output, sent, group.rank(), n, average, async_op, p2p)
        received = torch.empty_like(sent)
        work = dist.all_to_all_single(received, sent, group=group, async_op=async_op)

        def then():
            torch.sum(received.view(n, -1), dim=0, out=output)
            if average:
                output.div_(n)

        return work, then


def _reduce_scatter_shared(output: torch.Tensor, sent: torch.Tensor, rank: int, n: int,
                           average: bool, async_op: bool, p2p):
    """The reduce-scatter through shared memory: every other rank's chunk for this one is
    added into ``output`` where it lies (the first as ``own + it``), with no copy out."""
    parts, flat = sent.view(n, -1), output.view(-1)
    own, peers = parts[rank], [r for r in range(n) if r != rank]
    for r in peers:
        p2p.send([parts[r]], r, 0)
    works = [p2p.recv([own], r, 0, reduce=(lambda v: torch.add(own, v, out=flat)) if i == 0
                      else flat.add_) for i, r in enumerate(peers)]
    work = _AllOf(works)
    if not async_op:
        work.wait()

    def then():
        if average:
            output.div_(n)

    return work, then


def _exchange(p2p, sent, received, rank: int) -> list[dist.Work]:
    """Send ``sent[r]`` to every other rank r of ``p2p`` and post the receive of its message
    into ``received[r]``; the receives' works (the sends are done on return)."""
    peers = [r for r in range(len(sent)) if r != rank]
    for r in peers:
        p2p.send([sent[r]], r, 0)
    return [p2p.recv([received[r]], r, 0) for r in peers]


def _managed_params(module: nn.Module) -> list[torch.Tensor]:
    """The sharded parameters ``module``'s own FSDP2 group manages (not its sub-units')."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch < 2.13: one group or None
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return [fsdp_param.sharded_param for param_group in groups
            for fsdp_param in param_group.fsdp_params]


def use_gloo_collectives(modules: list[nn.Module], group: dist.ProcessGroup, *,
                         hsdp: bool = False, p2p=None) -> bool:
    """Give every FSDP module in ``modules`` the broadcast all-gather and the all-to-all
    reduce-scatter (left in flight unless ``hsdp``) when ``group`` is a gloo group (NCCL's
    own are rings already), both through shared memory with ``p2p`` (a LocalP2PGroup over
    ``group``'s ranks); whether it did."""
    if ReduceScatter is None or dist.get_backend(group) != "gloo":
        return False
    if p2p is not None:
        assert dist.get_process_group_ranks(p2p) == dist.get_process_group_ranks(group)
    gather = BroadcastAllGather() if p2p is None else SharedMemoryAllGather(p2p)
    in_flight = _InFlight()
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(
            AllToAllReduceScatter(in_flight, None if hsdp else module, p2p))
    return True


def set_prefetch(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Explicit prefetch over ``blocks`` (FSDP modules in forward order, ``model`` the root):
    each block's forward starts the next block's all-gather and each block's backward the
    previous block's, and pre-forward / pre-backward gathers are issued with ``async_op`` so
    the process group's thread moves the bytes while this one computes."""
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([block])
    model._set_unshard_async_op(True)
