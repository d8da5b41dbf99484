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

from meshtrain.errors import ConfigError
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
        self._stages: dict[tuple, list[int]] = {}  # split points per pipeline
        self._roles = None
        self._experts: set[str] | None = None

    def rank(self, layout: str | Layout, rank: int, *, world_size: int | None = None,
             pipeline=None) -> RankState:
        """``rank``'s model state under ``layout`` (``pipeline``: PipelineOptions, for the
        schedule and stages per rank; default: the one given at construction)."""
        start = time.perf_counter()
        layout = Layout.parse(layout, world_size or world_of(layout))
        coords = dict(zip(layout.axis_names, _unravel(rank, layout.mesh_shape)))
        tp = layout.degree("tp")
        tp_dims = self._tp_dims_for(tp) if tp > 1 else {}
        names = self._stage_names(layout, coords.get("pp", 0), pipeline) \
            if layout.degree("pp") > 1 else None
        shards, shard_index = self._sharding(layout, coords)
        ep = layout.expert_degree
        experts = self._expert_names() if ep > 1 else set()
        # under zero2/3 FSDP shards a rank's expert rows over the edp ranks holding the same
        stage_rank = rank % (layout.world_size // layout.degree("pp"))
        edp = layout.expert_data_degree if layout.is_sharded else 1
        local, count_trainable = [], 0
        for p in self.params:
            if names is not None and p.name not in names:
                continue
            shape = list(p.shape)
            dim = tp_dims.get(p.name)
            if dim is not None:
                shape[dim] = chunk_size(shape[dim], tp, coords["tp"])
            if p.name in experts:  # ep: this rank's rows of [E, ...] (edp: their shard)
                shape[0] //= ep
                if edp > 1:
                    shape[0] = chunk_size(shape[0], edp, stage_rank // ep)
            elif shards > 1 and shape:
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

    def _expert_names(self) -> set[str]:
        """The names of the expert weights ep splits by rows (meshtrain's MoE layers, or a
        Hugging Face model's from its declared ep plan), learned once on the meta device."""
        if self._experts is None:
            from meshtrain.parallel.expert.apply import expert_layers
            from meshtrain.plan.simulate import default_options

            with torch.device("meta"):
                model = self.factory()
            options, _ = default_options(Layout.parse("dp=1", 1), self.options, self.pipeline)
            prefix = {id(m): n for n, m in model.named_modules()}
            self._experts = {f"{prefix[id(layer.expert_module)]}.{n}"
                             for layer in expert_layers(model, options.expert_layers)
                             for n, _ in layer.expert_module.named_parameters(recurse=False)}
        return self._experts

    def _stage_names(self, layout: Layout, pp_rank: int, pipeline=None) -> set[str]:
        """The parameter names pipeline rank ``pp_rank``'s stages hold: the blocks of its stages
        (split as the Trainer splits them), the embedding on the first and the head on the last."""
        from meshtrain.parallel.pipeline.partition import partition_blocks
        from meshtrain.parallel.pipeline import rank_stages
        from meshtrain.plan.simulate import default_options

        pp = layout.degree("pp")
        _, pipeline = default_options(layout, self.options, pipeline or self.pipeline)
        blocks, block_names, first, last = self._pipeline_roles(pipeline)
        num_stages = pp * pipeline.stages_per_rank
        key = (num_stages, tuple(pipeline.split_points or ()))
        if key not in self._stages:
            self._stages[key] = partition_blocks(blocks, num_stages, balance="params",
                                                 split_points=pipeline.split_points)
        bounds = [0, *self._stages[key], len(blocks)]
        names: set[str] = set()
        for i in rank_stages(pp_rank, pp, pipeline.stages_per_rank, pipeline.schedule):
            names = names.union(*block_names[bounds[i]:bounds[i + 1]])
            names |= (first if i == 0 else set()) | (last if i == num_stages - 1 else set())
        return names

    def _pipeline_roles(self, pipeline):
        """(the whole model's blocks, each block's parameter names, the names only the first
        stage holds besides its blocks, those only the last holds): from the model's own split
        into two stages, learned once."""
        if self._roles is None:
            from meshtrain.parallel.pipeline import pipeline_blocks, split_model
            from meshtrain.parallel.pipeline.engine import pipeline_adapter

            def stage(index: int | None):
                with torch.device("meta"):
                    model = self.factory()
                adapter = pipeline_adapter(model, pipeline)
                blocks = (adapter.blocks if adapter is not None else pipeline_blocks)(model)
                if index is None:
                    return model, blocks
                split = (adapter.split if adapter is not None else split_model)
                return {n for n, _ in split(model, [len(blocks) // 2], index).named_parameters()}

            whole, blocks = stage(None)
            if len(blocks) < 2:
                raise ConfigError(f"the model has {len(blocks)} block(s): a pipeline needs two "
                                  "or more; drop pp")
            prefix = {id(m): n for n, m in whole.named_modules()}
            block_names = [{f"{prefix[id(b)]}.{n}" for n, _ in b.named_parameters()}
                           for b in blocks]
            every_block = set().union(*block_names)
            self._roles = (blocks, block_names, stage(0) - every_block, stage(1) - every_block)
        return self._roles

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
