"""Fully sharded data parallelism with FSDP2 (Zhao et al., VLDB 2023, "PyTorch FSDP").

ZeRO (Rajbhandari et al., SC 2020) removes the redundancy of data parallelism: each of the N
ranks keeps 1/N of the parameters, gradients and optimizer state. FSDP2's ``fully_shard`` turns
every parameter into a ``DTensor`` sharded on dim 0; before a module's forward (and backward) its
parameters are all-gathered, after backward its gradients are reduce-scattered. Sharding the
model block by block means only one block is ever gathered at a time.

* 1-D mesh: FSDP. ``reshard_after_forward=True`` frees the gathered parameters after forward
  (ZeRO-3); ``False`` keeps them until backward (ZeRO-2: gradients and optimizer state sharded).
* 2-D mesh ``(replicate, shard)``: HSDP. Shard inside each group, all-reduce across groups.

Built on the meta device first (meshtrain/parallel/data/meta_init.py), each rank allocates only
its own shards.
"""

from __future__ import annotations


import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from meshtrain.errors import ConfigError
from meshtrain.parallel.data.fsdp_comm import set_prefetch, use_gloo_collectives

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
OFFLOADS = (None, "cpu")


# ---------------------------------------------------------------------------------------------
# What to shard
# ---------------------------------------------------------------------------------------------
def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, *, min_num_params: int | None = None) -> list[nn.Module]:
    """The units to shard one by one, outermost first, never overlapping; ``[]`` if none.

    By default, the model's repeated blocks: children of an ``nn.ModuleList`` / ``nn.Sequential``
    whose class appears there at least twice and that have parameters (GPT's ``model.layers``;
    the Linear layers of a Sequential MLP). With ``min_num_params``, instead the largest
    submodules that hold at least that many parameters (containers without a forward, such as
    ``nn.ModuleList``, are looked into, never returned).
    """
    if min_num_params is not None and min_num_params < 1:
        raise ConfigError(f"min_num_params must be a positive integer, got {min_num_params!r}")
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if min_num_params is not None:
                callable_unit = not isinstance(child, (nn.ModuleList, nn.ModuleDict))
                if callable_unit and _num_params(child) >= min_num_params:
                    blocks.append(child)
                    continue
            elif isinstance(module, (nn.ModuleList, nn.Sequential)) and _num_params(child) > 0:
                if sum(type(other) is type(child) for other in module.children()) >= 2:
                    blocks.append(child)
                    continue
            visit(child)

    visit(model)
    return blocks


# ---------------------------------------------------------------------------------------------
# Options: precision and offload
# ---------------------------------------------------------------------------------------------
def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision: compute in half precision on gathered copies, reduce gradients in
    fp32, keep the sharded (master) parameters and optimizer state in fp32."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


def check_offload(offload: str | None, device_type: str) -> None:
    """Reject offload settings that cannot work, before any process group exists.

    ``offload="cpu"`` keeps the sharded parameters, gradients and optimizer state in (pinned) CPU
    memory to save GPU memory. On a CPU-only job everything already lives in CPU memory, so it
    would be a silent no-op at best; it is rejected so that nobody believes it is doing something.
    """
    if offload not in OFFLOADS:
        raise ConfigError(f"unknown offload {offload!r}; choose None (no offload) or 'cpu'")
    if offload == "cpu" and device_type == "cpu":
        raise ConfigError(
            "offload='cpu' moves the sharded parameters, gradients and optimizer state from GPU "
            "memory to CPU memory, but this job runs on the CPU (no GPU here), so there is "
            "nothing to offload; remove offload='cpu' or run on GPUs"
        )


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------
def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    precision: str = "fp32",
    offload: str | None = None,
    blocks: list[nn.Module] | None = None,
    unit_mb: float | None = None,
    p2p=None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 ``fully_shard``: each block, then the root.

    ``mesh`` is 1-D (FSDP: ZeRO-3, or ZeRO-2 with ``reshard_after_forward=False``) or 2-D with
    dims ``(replicate, shard)`` (HSDP). ``blocks`` defaults to :func:`find_blocks`; with no blocks
    only the root is sharded, which is correct but gathers the whole model at once. With
    ``unit_mb``, consecutive blocks are sharded together (one FSDP2 unit: one all-gather, one
    reduce-scatter) until a unit holds that many MiB of parameters (:func:`group_blocks`; the
    Trainer's ``shard_unit_mb``, 4 by default: on 2 gloo ranks a model of 256 KiB blocks trains
    1.7x faster under zero3 with them grouped, benchmarks/README.md). Gradients are
    averaged over the ranks, so each rank's loss should be the mean over its own samples.
    ``p2p``: a shared-memory group over the shard ranks (``ParallelMesh.local_p2p``), which the
    gloo collectives then run on. Returns ``model`` itself (now also an ``FSDPModule``).
    """
    if not any(True for _ in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} has no parameters, so there is nothing to shard; check that "
            "its layers are registered as attributes or in nn.ModuleList (not in a plain list)"
        )
    if mesh.ndim not in (1, 2):
        raise ConfigError(
            f"apply_fsdp needs a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a "
            f"{mesh.ndim}-D mesh {mesh.mesh_dim_names or ''}; pass the data-parallel sub-mesh"
        )
    check_offload(offload, mesh.device_type)
    options = dict(mesh=mesh, mp_policy=mixed_precision_policy(precision))
    if offload == "cpu":
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    from meshtrain.parallel.expert.apply import shard_experts

    # ep's experts: sharded over the ranks holding the same ones (each rank holds others)
    shard_experts(model, reshard_after_forward=reshard_after_forward,
                  **{k: v for k, v in options.items() if k != "mesh"})
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if any(block is model for block in blocks):
        raise ConfigError(
            "blocks contains the model itself, which apply_fsdp always shards last as the root; "
            "pass only its submodules (e.g. model.layers), or no blocks to shard the root alone"
        )
    units = group_blocks(blocks, round((unit_mb or 0) * 2**20))
    firsts = []
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again as soon as backward starts, so (as in
        # torchtitan) it is not resharded: this saves one all-gather and barely changes peak memory.
        last = i == len(units) - 1
        fully_shard(unit if len(unit) > 1 else unit[0],
                    reshard_after_forward=reshard_after_forward and not last, **options)
        firsts.append(unit[0])
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    # On gloo (CPU: no streams) meshtrain's collectives and explicit prefetch; on GPUs FSDP2's
    # own, with its stream-based implicit prefetching (not validated on a GPU otherwise)
    if use_gloo_collectives([*firsts, model], mesh.get_group(-1), hsdp=mesh.ndim == 2,
                            p2p=p2p):
        set_prefetch(model, firsts)
    return model


def group_blocks(blocks: list, min_bytes: int, size=None) -> list[list]:
    """Consecutive blocks grouped into units of at least ``min_bytes`` of parameters (the last
    unit may hold less; 0: one unit per block), so that each all-gather and reduce-scatter
    moves a useful size. ``size(block)``: its bytes (default: its parameters'); the planner
    groups plain sizes with ``size=lambda b: b``."""
    size = size or (lambda block: sum(p.numel() * p.element_size() for p in block.parameters()))
    units: list[list] = []
    held = min_bytes
    for block in blocks:
        if held >= min_bytes:
            units.append([])
            held = 0
        units[-1].append(block)
        held += size(block)
    return units
