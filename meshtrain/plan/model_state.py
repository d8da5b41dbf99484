"""Per-rank model-state bytes of any layout by arithmetic, for a planner that weighs many layouts
at once: what :func:`meshtrain.plan.simulate.simulate` reads from a built world, computed from
the model's parameter shapes instead (each fact that needs the model's own code is learned
once: which dimension its tensor-parallel plan splits, which parameters each pipeline stage
holds).

    sizes = ModelStateSizes(lambda: LlamaForCausalLM(config))
    sizes.rank(layout, rank)        # a simulate.RankState, without building the layout

The rules are FSDP2's and DTensor's: a tensor-parallel split takes ``torch.chunk``'s share of the
split dimension on each tp rank; FSDP then takes ``torch.chunk``'s share of the local tensor's
first dimension over the sharding ranks (``dp_shard``, times ``cp`` when context parallel);
ZeRO-1 divides the optimizer state over ``dp``. tests/plan/test_model_state.py checks every
rank of many layouts against simulate, byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from meshtrain.parallel.layout import Layout
from meshtrain.plan.simulate import RankState, world_of, fake_world


@dataclasses.dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    element_size: int
    trainable: bool


def chunk_size(length: int, parts: int, index: int) -> int:
    """The length of ``torch.chunk``'s part ``index`` when ``length`` is cut into ``parts``."""
    size = math.ceil(length / parts) if length else 0
    return max(0, min(size, length - index * size))


class ModelStateSizes:
    """The model's parameters (built once on the meta device) and, learned on demand, its
    tensor-parallel splits per tp degree and its pipeline stages' parameters."""

    def __init__(self, model: Callable[[], torch.nn.Module], *, options=None, pipeline=None,
                 optimizer_bytes_per_param: int = 8, optimizer_bytes_per_tensor: int = 4):
        self.factory, self.options, self.pipeline = model, options, pipeline
        self.per_param, self.per_tensor = optimizer_bytes_per_param, optimizer_bytes_per_tensor
        with torch.device("meta"):
            whole = model()
        self.params = [_Param(n, tuple(p.shape), p.element_size(), p.requires_grad)
                       for n, p in whole.named_parameters()]
        self.num_params = sum(math.prod(p.shape) for p in self.params)
        self._tp_dims: dict[int, dict[str, int | None]] = {}
        self._stages: dict[tuple, list[set[str]]] = {}

    def rank(self, layout: str | Layout, rank: int, *, world_size: int | None = None) -> RankState:
        start = time.perf_counter()
        layout = Layout.parse(layout, world_size or world_of(layout))
        coords = dict(zip(layout.axis_names, _unravel(rank, layout.mesh_shape)))
        tp = layout.degree("tp")
        tp_dims = self._tp_dims_for(tp) if tp > 1 else {}
        names = self._stage_names(layout, coords.get("pp", 0)) if layout.degree("pp") > 1 else None
        shards, shard_index = self._sharding(layout, coords)
        local, count_trainable = [], 0
        for p in self.params:
            if names is not None and p.name not in names:
                continue
            shape = list(p.shape)
            dim = tp_dims.get(p.name)
            if dim is not None:
                shape[dim] = chunk_size(shape[dim], tp, coords["tp"])
            if shards > 1 and shape:
                shape[0] = chunk_size(shape[0], shards, shard_index)
            local.append((math.prod(shape), p.element_size, p.trainable))
            count_trainable += p.trainable
        trainable = sum(n for n, _, t in local if t)
        optimizer = self.per_param * trainable + self.per_tensor * count_trainable
        if layout.zero_stage == 1:
            optimizer = -(-optimizer // layout.degree("dp"))
        return RankState(layout=str(layout), world_size=layout.world_size, rank=rank,
                         num_params=self.num_params, local_params=sum(n for n, _, _ in local),
                         params=sum(n * size for n, size, _ in local),
                         grads=sum(n * size for n, size, t in local if t),
                         optimizer=optimizer, seconds=time.perf_counter() - start)

    # -- what needs the model's own code, learned once ------------------------------------------
    def _tp_dims_for(self, tp: int) -> dict[str, int | None]:
        """{name: the dimension tp splits, or None}: from the model's plan applied on a fake
        tp-rank world."""
        if tp not in self._tp_dims:
            from torch.distributed.tensor import DTensor, Shard

            from meshtrain.plan.simulate import default_options, this_ranks_modules

            layout = Layout.parse(f"tp={tp}", tp)
            with fake_world(tp, 0):
                from meshtrain.parallel.mesh import ParallelMesh

                mesh = ParallelMesh(layout, "cpu")
                with torch.device("meta"):
                    model = self.factory()
                options, pipeline = default_options(layout, self.options, self.pipeline)
                (module,) = this_ranks_modules(model, mesh, options, pipeline)
                dims = {}
                for name, param in module.named_parameters():
                    shard = [pl for pl in param.placements if isinstance(pl, Shard)] \
                        if isinstance(param, DTensor) else []
                    dims[name] = shard[0].dim if shard else None
            self._tp_dims[tp] = dims
        return self._tp_dims[tp]

    def _stage_names(self, layout: Layout, pp_rank: int) -> set[str]:
        """The parameter names pipeline rank ``pp_rank``'s stages hold."""
        from meshtrain.parallel.partition import partition_blocks
        from meshtrain.parallel.pipeline import pipeline_blocks, rank_stages, split_model
        from meshtrain.parallel.pipeline_engine import pipeline_adapter
        from meshtrain.plan.simulate import default_options

        pp = layout.degree("pp")
        _, pipeline = default_options(layout, self.options, self.pipeline)
        key = (pp, pipeline.stages_per_rank, pipeline.schedule, tuple(pipeline.split_points or ()))
        if key not in self._stages:
            num_stages = pp * pipeline.stages_per_rank
            stages = []
            for index in range(num_stages):
                with torch.device("meta"):
                    model = self.factory()
                adapter = pipeline_adapter(model, pipeline)
                blocks_of = adapter.blocks if adapter is not None else pipeline_blocks
                split = partition_blocks(blocks_of(model), num_stages, balance="params",
                                         split_points=pipeline.split_points)
                stage = (adapter.split if adapter is not None else split_model)(model, split, index)
                stages.append({n for n, _ in stage.named_parameters()})
            self._stages[key] = stages
        stages = self._stages[key]
        indices = rank_stages(pp_rank, pp, pipeline.stages_per_rank, pipeline.schedule)
        return set().union(*(stages[i] for i in indices))

    @staticmethod
    def _sharding(layout: Layout, coords: dict) -> tuple[int, int]:
        """(ranks FSDP shards over, this rank's index among them); (1, 0) when not sharded."""
        if not layout.is_sharded:
            return 1, 0
        shards, index = layout.degree("dp_shard"), coords.get("dp_shard", 0)
        if layout.degree("cp") > 1:  # FSDP shards over dp_shard and cp together
            shards, index = shards * layout.degree("cp"), index * layout.degree("cp") + coords["cp"]
        return shards, index


def _unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``rank``'s coordinates in a row-major mesh of ``shape``."""
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))
