"""Fully sharded data parallelism with FSDP2 (Zhao et al., VLDB 2023, "PyTorch FSDP").

ZeRO (Rajbhandari et al., SC 2020) removes the redundancy of data parallelism: each of the N
ranks keeps 1/N of the parameters, gradients and optimizer state. FSDP2's ``fully_shard`` turns
every parameter into a ``DTensor`` sharded on dim 0; before a module's forward (and backward) its
parameters are all-gathered, after backward its gradients are reduce-scattered. Sharding the
model block by block means only one block is ever gathered at a time.

* 1-D mesh: FSDP. ``reshard_after_forward=True`` frees the gathered parameters after forward
  (ZeRO-3); ``False`` keeps them until backward (ZeRO-2: gradients and optimizer state sharded).
* 2-D mesh ``(replicate, shard)``: HSDP. Shard inside each group, all-reduce across groups.

Meta-device construction (``build_on_meta`` -> ``apply_fsdp`` -> ``materialize``) lets a model
that fits on no single rank be built: each rank only ever allocates its own shards, and the
model's ``init_weights()`` fills them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

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
    ignored = shard_experts(model, reshard_after_forward=reshard_after_forward,
                            **{k: v for k, v in options.items() if k != "mesh"})
    if ignored:
        options["ignored_params"] = ignored
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


# ---------------------------------------------------------------------------------------------
# Meta-device construction
# ---------------------------------------------------------------------------------------------
def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """Build ``factory()`` on the meta device: shapes and dtypes only, no parameter storage."""
    with torch.device("meta"):
        return factory()


def supports_meta_init(model_or_factory) -> bool:
    """Whether the model (a module, its class, or a factory) opts in to meta-device building:
    its class sets ``supports_sharded_init = True`` and defines ``init_weights()`` that fills
    sharded (DTensor) parameters with the values the unsharded model would get. (Many models
    have an ``init_weights``, e.g. Hugging Face's, that draws from the global random stream in
    its own order: sharded, that gives other values than one process, so it is not enough.)

    A factory that is not a class is built on the meta device to find out (which allocates
    nothing); one that cannot be built there does not support meta construction either.
    """
    target = model_or_factory
    while isinstance(target, functools.partial):
        target = target.func
    if _factory_initialises(target):  # a factory object that fills the shards itself
        return True
    if isinstance(target, nn.Module):
        target = type(target)
    if not inspect.isclass(target):
        try:
            target = type(build_on_meta(model_or_factory))
        except Exception:
            return False
    return (issubclass(target, nn.Module) and callable(getattr(target, "init_weights", None))
            and getattr(target, "supports_sharded_init", False) is True)


def _factory_initialises(factory) -> bool:
    """A factory object (not a class) that declares ``supports_sharded_init`` and has its own
    ``init_weights(model)`` (e.g. meshtrain.models.hf.init.HFCausalLM)."""
    return (not inspect.isclass(factory) and not isinstance(factory, nn.Module)
            and getattr(factory, "supports_sharded_init", False) is True
            and callable(getattr(factory, "init_weights", None)))


def initializer_of(factory):
    """The function that fills a model ``factory`` builds once materialised: the factory's own
    ``init_weights(model)`` when it has one (:func:`_factory_initialises`), else None (the
    model's ``init_weights()``)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory.init_weights if _factory_initialises(factory) else None


@torch.no_grad()
def copy_full_into(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Copy ``values`` (the whole tensor, the same on every rank) into ``tensor``: a DTensor keeps
    its own part (split locally, no communication), a plain tensor takes them all."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        part = distribute_tensor(values.to(tensor.device), tensor.device_mesh, tensor.placements,
                                 src_data_rank=None)
        tensor.to_local().copy_(part.to_local())
    else:
        tensor.copy_(values)


def materialize(model: nn.Module, device: torch.device | str, init=None) -> None:
    """Allocate a meta-built model's storage on ``device`` (after :func:`apply_fsdp`: only this
    rank's shards) and fill it with ``init(model)``, or else ``model.init_weights()``; buffers are
    that function's job too."""
    ties = _tie_groups(model)
    if init is not None:
        model.to_empty(device=torch.device(device))
        _retie(model, ties)
        init(model)
        return
    if not callable(getattr(model, "init_weights", None)):
        raise ConfigError(
            f"to build on the meta device a model needs init_weights() to fill its parameters "
            f"(and buffers) after they are allocated; {type(model).__name__} has none. Add an "
            f"init_weights(self) method, or build the model on a real device instead"
        )
    model.to_empty(device=torch.device(device))
    _retie(model, ties)
    model.init_weights()


def _tie_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that hold one parameter (tied embeddings), each group in the
    order FSDP meets them (its first is the one FSDP tracks, the others are its "shared")."""
    holders: dict[int, list] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, ties: list) -> None:
    """Give the tied attributes back their one parameter after ``to_empty``, which gives plain
    tensors storage of their own each (a pipeline stage's; a DTensor keeps its object): the
    first holder's, so the optimizer, the gradient and the checkpoint see one tensor."""
    for (first, name), *others in ties:
        for module, other in others:
            module._parameters[other] = first._parameters[name]


def builds_on_meta(layout, meta_init, model, meta_model, measures_blocks: bool = False) -> bool:
    """Build the model on the meta device, so each rank allocates only its own shards? Needs
    a sharded, tensor- or pipeline-parallel layout, a factory (not a built module) and a model
    that supports sharded init; under pp one that fills each module from its own name
    (``initializer_of``: HFCausalLM; a class with ``supports_staged_init``: meshtrain's GPT), as
    a stage holds only some modules, and not when the split measures the blocks on real values
    (``measures_blocks``: pp_balance "time" or "memory").
    ``meta_init=True`` insists (ConfigError when impossible); "auto" falls back (the Trainer
    then says at start that each rank builds the whole model, and what it costs)."""
    import torch

    splits = layout.is_sharded or layout.degree("tp") > 1 or layout.degree("pp") > 1
    # under pp only a factory whose init fills each module from its own name (HFCausalLM):
    # a stage holds some modules, under their full-model names
    staged = layout.degree("pp") == 1 or not measures_blocks and (
        initializer_of(model) is not None
        or getattr(type(meta_model), "supports_staged_init", False) is True)
    on_meta = (splits and staged and meta_init is not False
               and not isinstance(model, torch.nn.Module) and meta_model is not None
               and (initializer_of(model) is not None or supports_meta_init(meta_model)))
    if meta_init is True and not on_meta:
        raise ConfigError(
            "meta_init=True needs a sharded, tensor- or pipeline-parallel layout, a model "
            "factory (not a built module; under pp one that initialises module by module by "
            "name, such as HFCausalLM) "
            "and a model that supports sharded init (supports_sharded_init = True and "
            "init_weights()); use meta_init='auto' to fall back quietly")
    return on_meta


def whole_build_reason(layout, meta_init, model, meta_model,
                       measures_blocks: bool = False) -> str | None:
    """Why each rank builds the whole model although ``layout`` splits its parameters (None:
    the layout does not split them, or the model is built on the meta device)."""
    if not (layout.is_sharded or layout.degree("tp") > 1 or layout.degree("pp") > 1):
        return None
    if builds_on_meta(layout, "auto" if meta_init is True else meta_init, model, meta_model,
                      measures_blocks):
        return None
    if meta_init is False:
        return "meta_init=False"
    if isinstance(model, nn.Module):
        return ("the model was given built; a factory (e.g. lambda: MyModel(...)) is built on "
                "the meta device where it supports sharded initialisation")
    if layout.degree("pp") > 1 and measures_blocks:
        return "pp_balance measures the blocks on real values (pp_balance=\"params\" does not)"
    if layout.degree("pp") > 1:
        return ("a pipeline's stages are cut from the whole model (pp) unless the model "
                "initialises module by module by name (supports_staged_init, HFCausalLM)")
    if meta_model is None:
        return _meta_failure(model)
    return (f"{type(meta_model).__name__} has no sharded initialisation (supports_sharded_init "
            "= True and init_weights(); a Hugging Face model: its factory HFCausalLM(cls, "
            "config), unless its _init_weights writes its children's "
            "tensors)")


def _meta_failure(factory) -> str:
    """Why ``factory`` cannot be built on the meta device (it is called there again)."""
    try:
        with torch.device("meta"):
            factory()
    except Exception as error:  # noqa: BLE001 -- what to tell the user
        if "from_pretrained" in str(error):  # (transformers refuses to load onto meta)
            return ("a from_pretrained factory loads the whole checkpoint on every rank; to "
                    "read only each rank's shards give its folder as init_from= with a factory "
                    "that builds the model from its config (meshtrain.models.hf.init."
                    "HFCausalLM(cls, AutoConfig.from_pretrained(folder)))")
        return f"the factory cannot be built on the meta device ({type(error).__name__})"
    return "the factory cannot be built on the meta device"
