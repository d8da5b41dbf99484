"""A layout built for real at any world size, in one process and with no memory: torch's fake
process group, the model on the meta device, and the same code the Trainer applies (pipeline
split and this rank's stages, tensor and context parallelism, activation checkpointing,
FSDP2/DDP); then one rank's parameter, gradient and optimizer bytes read from what was built.

    from meshtrain.plan.simulate import simulate
    state = simulate(lambda: GPT(config), "pp=4,dp_shard=8,tp=8", rank=0)   # 256 ranks
    state.params, state.grads, state.optimizer, state.total                  # bytes

The fake group answers every collective at once without moving data, so nothing is trained:
this is for sizes and for checking that a layout can be built (a refusal is the Trainer's).
It needs a process without a process group (it makes and ends its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.loop.setup import choose_build
from meshtrain.observe.memory.zero_formulas import ModelStateBytes, local_tensor
from meshtrain.parallel.apply import ParallelOptions, parallelize
from meshtrain.parallel.data.meta_init import SetupBytes, setup_bytes
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.mesh import ParallelMesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankState(ModelStateBytes):
    """One rank's model state in a simulated world (bytes: ``params``, ``grads``, ``optimizer``,
    ``total``), and what it took to build."""

    layout: str
    world_size: int
    rank: int
    num_params: int  # the whole model's parameter elements
    local_params: int  # elements stored on this rank
    seconds: float
    # set-up, as the Trainer builds this rank (meshtrain.parallel.data.meta_init.SetupBytes)
    setup: SetupBytes | None = None
    whole_build: str | None = None  # why each rank builds the whole model first (None: not)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The default process group of a ``world_size``-rank job, seen from ``rank``; no data moves."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("simulate builds a world of its own: call it in a process without a "
                          "process group (not inside a training job)")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of {world_size} ranks (0..{world_size - 1})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate(model: Callable[[], torch.nn.Module], layout: str | Layout, *,
             world_size: int | None = None, rank: int = 0,
             options: ParallelOptions | None = None, pipeline=None,
             optimizer_bytes_per_param: int = 8, optimizer_bytes_per_tensor: int = 4,
             ) -> RankState:
    """Build ``layout`` on ``world_size`` ranks (default: the layout's) as rank ``rank`` sees it
    and return its model-state bytes, and what building it costs the rank before its first step
(``setup``: the Trainer's choice, on meta or whole, :func:`meshtrain.loop.setup.choose_build`).
``model``: a factory, called under the meta device.
    Gradients are counted as the trainable local parameters (FSDP shards them like the
    parameters); the optimizer as ``optimizer_bytes_per_param`` per trainable local element
    (AdamW in fp32: 8) plus ``optimizer_bytes_per_tensor`` per trainable parameter tensor
    (AdamW's ``step`` counter), divided over the ``dp`` ranks under ZeRO-1 (which splits whole
    parameters, so a rank's real share may differ)."""
    start = time.perf_counter()
    spec = layout
    layout = Layout.parse(spec, world_size or world_of(spec))
    if layout.num_servers:
        raise ConfigError("simulate builds mesh layouts; parameter servers (ps=S) hold the whole "
                          "model on each server: size them with the model's own bytes")
    options, pipeline = default_options(layout, options, pipeline)
    with fake_world(layout.world_size, rank):
        mesh = ParallelMesh(layout, "cpu")
        with torch.device("meta"):
            whole = model()
        num_params = sum(p.numel() for p in whole.parameters())
        whole_bytes = sum(t.numel() * t.element_size()
                          for t in (*whole.parameters(), *whole.buffers()))
        choice = choose_build(layout, "auto", model, whole, seed=0)
        modules = this_ranks_modules(whole, mesh, options, pipeline)
        setup = setup_bytes(modules, choice.on_meta, whole_bytes)
        params = [p for m in modules for p in m.parameters()]
    local = [(local_tensor(p).numel(), p.element_size(), p.requires_grad) for p in params]
    trainable = sum(n for n, _, grad in local if grad)
    optimizer = (optimizer_bytes_per_param * trainable
                 + optimizer_bytes_per_tensor * sum(1 for _, _, grad in local if grad))
    if layout.zero_stage == 1:
        optimizer = -(-optimizer // layout.degree("dp"))
    return RankState(layout=str(layout), world_size=layout.world_size, rank=rank,
                     num_params=num_params, local_params=sum(n for n, _, _ in local),
                     params=sum(n * size for n, size, _ in local),
                     grads=sum(n * size for n, size, grad in local if grad),
                     optimizer=optimizer, seconds=time.perf_counter() - start, setup=setup,
                     whole_build=choice.why_whole)


def default_options(layout: Layout, options, pipeline, *, sequence_parallel: bool = False):
    """``options`` and ``pipeline``, or as the Trainer makes them (Hugging Face models: their
    own plans)."""
    from meshtrain.parallel.pipeline.engine import PipelineOptions

    if options is None:
        from meshtrain.models.hf import (hf_cp_support, hf_expert_layers, hf_loss_items,
                                         hf_router_loss, hf_tp_plans)

        options = ParallelOptions(tp_plan=hf_tp_plans(layout.degree("tp"), sequence_parallel,
                                                      False),
                                  sequence_parallel=sequence_parallel,
                                  context_parallel=hf_cp_support, loss_items=hf_loss_items,
                                  router_loss=hf_router_loss,
                                  expert_layers=hf_expert_layers)
    if pipeline is None:
        from meshtrain.models.hf import hf_pp_support

        pipeline = PipelineOptions(adapter=hf_pp_support)
    return options, pipeline


def world_of(spec) -> int:
    """The world size a layout string names (``Layout.processes_of``)."""
    if isinstance(spec, Layout):
        return spec.world_size
    try:
        return Layout.processes_of(str(spec))
    except ConfigError as error:
        raise ConfigError(f"{error} (e.g. dp_shard=8,tp=8)") from None


def this_ranks_modules(model, mesh: ParallelMesh, options, pipeline) -> list[torch.nn.Module]:
    """The module(s) this rank holds once the layout is applied: the model, or its stages."""
    cpu = torch.device("cpu")
    if mesh.layout.degree("pp") == 1:
        parallelize(model, mesh, device=cpu, options=options, ddp=False)
        return [model]
    from meshtrain.parallel.pipeline.partition import partition_blocks
    from meshtrain.parallel.pipeline import pipeline_blocks, rank_stages, split_model
    from meshtrain.parallel.pipeline.engine import pipeline_adapter

    if pipeline.balance != "params" and pipeline.split_points is None:
        raise ConfigError(f"pp_balance={pipeline.balance!r} measures the blocks on real data; "
                          "simulate a pipeline with pp_balance='params' or split_points")
    pp = mesh.layout.degree("pp")
    adapter = pipeline_adapter(model, pipeline)
    blocks_of = adapter.blocks if adapter is not None else pipeline_blocks
    split = partition_blocks(blocks_of(model), pp * pipeline.stages_per_rank, balance="params",
                             split_points=pipeline.split_points)
    indices = rank_stages(mesh.axis("pp").get_local_rank(), pp, pipeline.stages_per_rank,
                          pipeline.schedule)
    stages = [(adapter.split if adapter is not None else split_model)(model, split, i)
              for i in indices]
    stage_options = dataclasses.replace(options, blocks=blocks_of)
    for stage in stages:
        parallelize(stage, mesh, device=cpu, options=stage_options, ddp=False)
    return stages
