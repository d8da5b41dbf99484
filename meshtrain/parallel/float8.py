"""float8 training through torchao (the ``float8`` setting; docs/precision.md).

torchao's ``convert_to_float8_training`` swaps each eligible ``nn.Linear`` for its
``Float8Linear``: the input, the weight and the output gradient are cast to float8 with dynamic
scales before each of the layer's three matmuls; the weight, its gradient and the optimizer
state stay in the parameters' dtype. The swap runs first on each model (or pipeline stage) in
``parallelize`` (parallel/apply.py), before tensor parallel, so every later layout sees the
float8 layers, as torchtitan orders it.

Recipes (torchao's ``Float8LinearConfig.from_recipe_name``):

* ``"tensorwise"``: one scale per tensor (e4m3 forward, e5m2 gradients). Under ``zero2``/``zero3``
  FSDP2 all-gathers the weights in float8 (torchao's ``enable_fsdp_float8_all_gather``: a
  quarter of fp32's bytes); under ``tp`` the float8 layers take torchao's ``Float8ColwiseParallel``
  / ``Float8RowwiseParallel`` in place of the plan's column/row styles (inputs cast to float8
  before their all-gather), except with ``sequence_parallel`` on CPU: gloo has no float8
  all-gather ("RuntimeError: Invalid scalar type"), so there the plan's own styles stay.
* ``"rowwise"``: one scale per row (e4m3 throughout, scales rounded to powers of two); weights are
  gathered in high precision and the plan's styles stay, as torchtitan does.

Eligible: an ``nn.Linear`` whose ``in_features`` and ``out_features`` are multiples of 16 (the
float8 matmul's requirement), except the output head (a module named ``head``, ``lm_head`` or
``output``: its logits feed the loss directly; torchtitan leaves ``output`` out too).

Hardware: float8 matmuls need a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper,
Blackwell). Anywhere else float8 is refused before start unless ``float8_emulate=True``
(torchao's ``emulate``: the same casts and scales, the matmul in high precision; the CPU tests
run it). torch 2.13's CPU build does run a float8 ``_scaled_mm``, but measured 1800-2300x slower
than fp32 (docs/precision.md), so the CPU is refused too.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # CUDA compute capability with float8 tensor cores (Ada, Hopper)
HEAD_NAMES = ("head", "lm_head", "output")
MULTIPLE = 16


def check_torchao() -> None:
    """``ConfigError`` with the install command when torchao is missing (no import)."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8 training runs through torchao, which is not installed: "
                          "pip install 'meshtrain[float8]' (or pip install torchao)")


def _capabilities() -> list[tuple[int, int]]:
    return [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]


def check_float8(recipe: str | None, emulate: bool, device_type: str, precision: str) -> None:
    """Refuse float8 where it cannot run: an unknown recipe, torchao missing, fp16-mixed, or a
    device without float8 matmuls (CPU, CUDA below compute capability 8.9) unless emulated."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ConfigError(f"unknown float8 recipe {recipe!r}; choose one of "
                          f"{', '.join(RECIPES)} (or None: no float8)")
    check_torchao()
    if precision == "fp16-mixed":
        raise ConfigError("float8 with precision='fp16-mixed' is not supported: torchao's "
                          "float8 training is made for bf16 and fp32 around the float8 "
                          "matmuls; use precision='bf16-mixed' (or 'fp32') with float8")
    if emulate:
        return
    if device_type != "cuda":
        raise ConfigError(
            f"float8={recipe!r} needs float8 matmuls, which only CUDA GPUs of compute "
            f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} have (H100, H200, L4, "
            f"B200, ...), and this run is on {device_type}; train on such a GPU, or set "
            "float8_emulate=True to run torchao's emulation (the same float8 casts, the "
            "matmuls in high precision: for checking numerics, not for speed)")
    low = [(i, cap) for i, cap in enumerate(_capabilities()) if cap < MIN_CAPABILITY]
    if low:
        i, (major, minor) = low[0]
        raise ConfigError(
            f"float8={recipe!r} needs CUDA compute capability >= {MIN_CAPABILITY[0]}."
            f"{MIN_CAPABILITY[1]} (float8 tensor cores: H100, H200, L4, B200, ...); GPU {i} "
            f"({torch.cuda.get_device_name(i)}) has {major}.{minor}. Use such a GPU, or "
            "float8_emulate=True (numerics only, no speed-up), or drop float8")


def eligible(module: nn.Module, name: str) -> bool:
    """Does ``module`` (named ``name`` in its model) train in float8? (torchao's filter)"""
    return (isinstance(module, nn.Linear) and name.rpartition(".")[2] not in HEAD_NAMES
            and module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0)


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the layers :func:`apply_float8` would swap."""
    return [name for name, module in model.named_modules() if eligible(module, name)]


def check_float8_model(model: nn.Module, recipe: str) -> None:
    """``ConfigError`` when no layer of ``model`` is eligible (float8 would change nothing);
    runs on the meta copy before start."""
    if float8_layers(model):
        return
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    seen = ", ".join(f"{n} ({m.in_features}x{m.out_features})" for n, m in linears[:4])
    raise ConfigError(
        f"float8={recipe!r} would change nothing: no nn.Linear of the model has in_features and "
        f"out_features that are multiples of {MULTIPLE} (besides the output head: "
        f"{', '.join(HEAD_NAMES)}){'; its linears: ' + seen if seen else ''}. Use sizes that "
        "are multiples of 16, or drop float8")


def float8_config(recipe: str, *, emulate: bool, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``fsdp_all_gather``: FSDP2 gathers the
    weights in float8 (tensorwise only)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather
                               and recipe == "tensorwise")


def apply_float8(model: nn.Module, recipe: str, *, emulate: bool, sharded: bool) -> list[str]:
    """Swap the eligible layers of ``model`` in place for torchao's ``Float8Linear``; return
    their names. ``sharded``: FSDP2 will shard them (tensorwise: all-gathered in float8)."""
    from torchao.float8 import convert_to_float8_training

    names = float8_layers(model)
    config = float8_config(recipe, emulate=emulate, fsdp_all_gather=sharded)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, name: eligible(module, name))
    return names


def uses_float8_styles(recipe: str | None, *, sequence_parallel: bool, device: torch.device
                       ) -> bool:
    """Whether tp gives the float8 layers torchao's float8 styles (see the module's docstring)."""
    return recipe == "tensorwise" and not (sequence_parallel and device.type == "cpu")


def float8_tp_plan(model: nn.Module, plan: dict) -> dict:
    """``plan`` with each column/row-parallel style of a float8 layer replaced by torchao's float8
    style with the same layouts: torch's ``ColwiseParallel`` / ``RowwiseParallel`` and meshtrain's
    versions of them with their own sequence collectives. Another subclass (a style of its own
    making), and a key matching a layer that is not float8, stay as they are."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel, Float8RowwiseParallel)

    from meshtrain.parallel.tensor.sequence_parallel import (
        ColwiseFromSequence, RowwiseToSequence)
    from meshtrain.parallel.tensor.tensor_parallel import module_matches

    swaps = {ColwiseParallel: Float8ColwiseParallel, ColwiseFromSequence: Float8ColwiseParallel,
             RowwiseParallel: Float8RowwiseParallel, RowwiseToSequence: Float8RowwiseParallel}

    modules = dict(model.named_modules())
    out = {}
    for key, style in plan.items():
        matched = [m for n, m in modules.items() if module_matches(n, key)]
        float8 = bool(matched) and all(isinstance(m, Float8Linear) for m in matched)
        kind = swaps.get(type(style))
        if not float8 or kind is None:
            out[key] = style
            continue
        out[key] = kind(input_layouts=style.input_layouts[0],
                        output_layouts=style.output_layouts[0],
                        use_local_output=style.use_local_output)
    return out



def describe_float8(modules: list[nn.Module], options, layout, device: torch.device) -> str:
    """The line said at start: how many of this rank's linear layers train in float8, and how
    FSDP2 and tp treat them."""
    from torchao.float8.float8_linear import Float8Linear

    linears = [m for module in modules for m in module.modules() if isinstance(m, nn.Linear)]
    float8 = sum(isinstance(m, Float8Linear) for m in linears)
    recipe = options.float8
    line = (f"float8 (torchao, {recipe}{', emulated' if options.float8_emulate else ''}): "
            f"{float8} of {len(linears)} linear layers" + (" on this rank" if
                                                           layout.degree("pp") > 1 else ""))
    if layout.is_sharded:
        line += ("; FSDP2 all-gathers their weights in float8" if recipe == "tensorwise" else
                 "; FSDP2 all-gathers their weights in high precision")
    if layout.degree("tp") > 1:
        line += ("; tp: torchao's float8 styles" if uses_float8_styles(
            recipe, sequence_parallel=options.sequence_parallel, device=device) else
            "; tp: the plan's own styles" + (" (gloo has no float8 all-gather)"
                                             if recipe == "tensorwise" else ""))
    return line
