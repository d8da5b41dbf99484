"""What one training micro-batch costs a rank, read from the model's own code run on the meta
device in a simulated world: the activations autograd saves, the FLOPs of forward and backward,
and the collectives tensor and context parallelism issue, per block and outside the blocks.

    probe = probe_model(spec, tp=8, cp=1, sequence_parallel=True, seq_len=8192)
    probe.block.saved        # bytes one block keeps for its backward, for one sample

Nothing is computed (meta tensors), so a 405B-wide block is probed in a fraction of a second.
The model is built twice, with one and with two blocks: what the second block adds is one
block's cost, the rest is the embedding, head and loss. Everything is for one sample (micro-batch
1) and scales linearly with the micro-batch. Activation checkpointing is derived, not run: under
"full" a block keeps only its input and recomputes its forward; under "selective" it keeps its
input and the outputs of the ops the policy saves (matmuls, attention:
meshtrain/parallel/activation_checkpointing.py) and recomputes only the cheap rest.
"""

from __future__ import annotations

import dataclasses
import functools
import unittest.mock

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from meshtrain.parallel.activation_checkpointing import SAVE_OPS
from meshtrain.parallel.layout import Layout
from meshtrain.plan.simulate import default_options, fake_world, this_ranks_modules

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")
_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
        "broadcast": "broadcast"}

#: FLOPs per (batch x heads x queries x keys x head dim) of CPU flash attention, which torch's
#: counter lacks: two matmuls forward, four backward (as its GPU kernels are counted); and
#: where the query is among the arguments (the backward's first is the output's gradient).
_CPU_FLASH = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (4, 0),
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (8, 1)}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective: ``op`` as ``meshtrain bench comm`` names it, ``bytes`` as nccl-tests
    sizes it (all_gather: the output; reduce_scatter: the input), over ``ranks`` ranks of mesh
    axis ``axis`` ("tp", "cp", or "" for any other group)."""

    op: str
    bytes: int
    ranks: int
    axis: str = ""


@dataclasses.dataclass(frozen=True)
class Cost:
    """One sample's cost of a part of the model on one rank."""

    saved: int = 0  # activation bytes kept from forward to backward (no checkpointing)
    saved_selective: int = 0  # the same under selective checkpointing
    inputs: int = 0  # bytes of the part's input (what full checkpointing keeps)
    forward_flops: int = 0
    flops: int = 0  # forward and backward
    comm: tuple[Collective, ...] = ()

    def minus(self, other: Cost) -> Cost:
        comm = list(self.comm)
        for c in other.comm:
            if c in comm:
                comm.remove(c)
        return Cost(*(getattr(self, f.name) - getattr(other, f.name)
                      for f in dataclasses.fields(self) if f.name != "comm"), tuple(comm))


@dataclasses.dataclass(frozen=True)
class Probe:
    """One rank's per-sample costs at one (tp, cp, sequence_parallel, seq_len)."""

    block: Cost  # one block
    first: Cost  # before the first block (embedding); saved bytes and forward FLOPs only
    last: Cost  # after the last block: head and loss; the outside collectives
    dtype_bytes: int


class _Recorder(TorchDispatchMode):
    """FLOPs (on each rank's local shapes), collectives, and which op made each tensor."""

    def __init__(self, axes: dict[str, str] | None = None) -> None:
        super().__init__()
        self.axes = axes or {}  # {group name: mesh axis} of the tp and cp axes: tags collectives
        self.flops = 0
        self.comm: list[Collective] = []
        self.saved_by_policy: set[int] = set()  # storages made by ops selective checkpointing keeps
        self.in_forward = True
        self._alive: list[torch.Tensor] = []  # ... kept alive, so that no other reuses their id

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self._collective(func, args)
        elif func._overloadpacket in _CPU_FLASH:
            factor, first = _CPU_FLASH[func._overloadpacket]
            q, k = _local(args[first]), _local(args[first + 1])  # (batch, heads, length, dim)
            self.flops += factor * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        elif func._overloadpacket in flop_registry:
            local = functools.partial(tree_map, _local)
            self.flops += flop_registry[func._overloadpacket](*local(args), **local(kwargs),
                                                              out_val=local(out))
        if func in SAVE_OPS and self.in_forward:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.saved_by_policy.add(_storage(t))
                    self._alive.append(t)
        return out

    def _collective(self, func, args) -> None:
        name = func.__name__.split(".")[0]
        if name not in _OPS:
            return
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = [a for a in args if isinstance(a, str)][-1]
        ranks = _resolve_process_group(group).size()
        tensor = next(a for a in args if isinstance(a, torch.Tensor))
        size = tensor.numel() * tensor.element_size()
        if _OPS[name] == "all_gather":
            size *= ranks
        self.comm.append(Collective(_OPS[name], size, ranks,
                                    self.axes.get(group, "")))


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    """SDPA as the fused kernels run it (GPU flash/efficient, CPU flash): keeping the output and
    its log-sum-exp, not the probabilities. On meta, torch would pick the math path, which saves
    the whole (sequence x sequence) attention matrix that no training run keeps."""
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    width = value.size(-1)  # (MLA: values narrower than queries and keys, DeepSeek-V3 128 < 192)
    if width != query.size(-1):  # the CPU kernel's meta gives the query's width: pad as FA does
        value = F.pad(value, (0, query.size(-1) - width))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0][..., :width]


def _local(x):
    return x._local_tensor if isinstance(x, DTensor) else x


def _storage(t: torch.Tensor) -> int:
    return _local(t).untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.untyped_storage().nbytes()


def _measure(spec, num_layers: int, tp: int, cp: int, sequence_parallel: bool, seq_len: int,
             dtype: torch.dtype) -> tuple[Cost, int, int]:
    """(the whole model's cost, saved bytes before the first block, forward FLOPs before it)."""
    world = tp * cp
    layout = Layout.parse(",".join(f"{a}={d}" for a, d in (("cp", cp), ("tp", tp)) if d > 1)
                          or "dp=1", world)
    with fake_world(world, 0):
        with torch.device("meta"):
            model = spec.build(num_layers).to(dtype)
        options, pipeline = default_options(layout, None, None,
                                            sequence_parallel=sequence_parallel)
        axes = {}
        if layout.degrees:
            from meshtrain.parallel.mesh import ParallelMesh

            mesh = ParallelMesh(layout, "cpu")
            (model,) = this_ranks_modules(model, mesh, options, pipeline)
            axes = {mesh.axis(axis).get_group().group_name: axis
                    for axis, degree in (("tp", tp), ("cp", cp)) if degree > 1}
        params = {_storage(p) for p in model.parameters()}
        blocks = spec.blocks(model)
        saved: dict[int, int] = {}
        recorder = _Recorder(axes)
        marks: dict[str, tuple[int, int]] = {}
        inputs = []

        def pack(t):
            key = _storage(t)
            if key not in params:
                saved[key] = _nbytes(t)
            return t

        def before_first(module, args, kwargs):
            marks.setdefault("first", (sum(saved.values()), recorder.flops))
            inputs.append(sum(_nbytes(a) for a in tree_flatten((args, kwargs))[0]
                              if isinstance(a, torch.Tensor) and a.is_floating_point()))

        handles = [b.register_forward_pre_hook(before_first, with_kwargs=True) for b in blocks]
        tokens = torch.zeros(1, seq_len // cp, dtype=torch.long, device="meta")
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                unittest.mock.patch.object(F, "scaled_dot_product_attention", _flash_attention):
            loss = spec.loss(model, tokens)
            forward_flops, recorder.in_forward = recorder.flops, False
            loss.backward()
        for h in handles:
            h.remove()
    total = Cost(saved=sum(saved.values()),
                 saved_selective=sum(n for k, n in saved.items() if k in recorder.saved_by_policy),
                 inputs=sum(inputs), forward_flops=forward_flops, flops=recorder.flops,
                 comm=tuple(recorder.comm))
    first_saved, first_flops = marks.get("first", (0, 0))
    return total, first_saved, first_flops


@functools.lru_cache(maxsize=256)
def probe_model(spec, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                seq_len: int, dtype: torch.dtype = torch.float32) -> Probe:
    """Per-sample costs of ``spec``'s model on one rank of a ``tp`` x ``cp`` group."""
    one, first_saved, first_flops = _measure(spec, 1, tp, cp, sequence_parallel, seq_len, dtype)
    two, _, _ = _measure(spec, 2, tp, cp, sequence_parallel, seq_len, dtype)
    block = two.minus(one)
    outside = one.minus(block)
    first = Cost(saved=first_saved, forward_flops=first_flops, flops=3 * first_flops)
    last = dataclasses.replace(outside.minus(first), inputs=0)
    # selective checkpointing keeps the block input besides the policy's outputs
    block = dataclasses.replace(block, saved_selective=min(block.saved,
                                                           block.saved_selective + block.inputs))
    return Probe(block=block, first=first, last=last,
                 dtype_bytes=torch.empty((), dtype=dtype).element_size())


@functools.lru_cache(maxsize=16)
def probe_own(spec, dtype: torch.dtype = torch.float32) -> Probe:
    """Per-sample costs of a user's own model (plan/own_model.py): one forward and backward of
    the whole model on meta with the job's sample and loss, split at its blocks' boundaries
    by hooks (a block: the average of its blocks; the backward's FLOPs shared out as the
    forward's)."""
    with torch.device("meta"):
        model = spec.build().to(dtype)
    params = {_storage(p) for p in model.parameters()}
    blocks = spec.blocks(model)
    saved: dict[int, int] = {}
    recorder = _Recorder(None)
    marks: list[tuple[int, int, frozenset]] = []  # at the first block's start, the last's end
    inputs: list[int] = []

    def pack(t):
        key = _storage(t)
        if key not in params:
            saved[key] = _nbytes(t)
        return t

    def mark():
        return sum(saved.values()), recorder.flops, frozenset(saved)

    def before(module, args, kwargs):
        if not marks:
            marks.append(mark())
        inputs.append(sum(_nbytes(a) for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, torch.Tensor) and a.is_floating_point()))

    def after(module, args, kwargs, output):
        marks[1:] = [mark()]

    handles = [h for b in blocks for h in (
        b.register_forward_pre_hook(before, with_kwargs=True),
        b.register_forward_hook(after, with_kwargs=True))]
    batch = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                     and t.is_floating_point() else t, spec.batch(1, device="meta"))
    try:
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = spec.loss(model, batch)
            forward_flops, recorder.in_forward = recorder.flops, False
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    (first_saved, first_flops, first_keys), (end_saved, end_flops, end_keys) = marks
    n = len(blocks)
    backward = (recorder.flops - forward_flops) / max(1, forward_flops)  # per forward FLOP
    inside = end_keys - first_keys
    block = Cost(saved=(end_saved - first_saved) // n,
                 saved_selective=min((end_saved - first_saved) // n, sum(
                     saved[k] for k in inside if k in recorder.saved_by_policy) // n
                     + max(inputs) if inputs else 0),
                 inputs=max(inputs) if inputs else 0,
                 forward_flops=(end_flops - first_flops) // n,
                 flops=round((end_flops - first_flops) / n * (1 + backward)))
    first = Cost(saved=first_saved, forward_flops=first_flops,
                 flops=round(first_flops * (1 + backward)))
    rest = forward_flops - end_flops
    last = Cost(saved=sum(saved.values()) - end_saved, forward_flops=rest,
                flops=round(rest * (1 + backward)))
    return Probe(block=block, first=first, last=last,
                 dtype_bytes=torch.empty((), dtype=dtype).element_size())

