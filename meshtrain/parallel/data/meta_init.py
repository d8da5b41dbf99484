"""Models built on the meta device and materialised per rank: which models can be, the
decision the Trainer and the planner's simulated world share, and the set-up memory it costs.

``build_on_meta`` -> the layout (``apply_fsdp``, tensor parallel, this rank's pipeline stages)
-> ``materialize``: each rank only ever allocates its own shards, and the model's
``init_weights()`` (or its factory's) fills them with the values one process would get.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError


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
def copy_full_into(tensor: torch.Tensor, values: torch.Tensor, rows: slice | None = None) -> None:
    """Copy ``values`` (the whole tensor, the same on every rank) into ``tensor``: a DTensor keeps
    its own part (split locally, no communication), a plain tensor takes them all. ``rows``:
    ``tensor`` holds only those rows of the whole (an expert holder's under ep, its ``rows``).
    While the set-up checks the initial values (init_check.py), the whole is noted."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from meshtrain.parallel.data.init_check import note_whole

    note_whole(tensor, values)
    if rows is not None:
        values = values[rows]
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
    _check_has_init_weights(model)
    model.to_empty(device=torch.device(device))
    _retie(model, ties)
    model.init_weights()


def materialize_checked(modules: list[nn.Module], device, init, group, skip=()) -> int:
    """:func:`materialize` each of this rank's ``modules`` (the model or its pipeline stages),
    then check over ``group`` (every rank) that the ranks' parts of each tensor the
    initializer handed to :func:`copy_full_into` make up the whole it drew (init_check.py),
    but those named in ``skip`` (a weight tied across pipeline stages: the first stage's copy
    takes the last's after this). Returns the number of tensors checked."""
    from meshtrain.parallel.data.init_check import check_initial_values, recording

    with recording() as notes:
        for module in modules:
            materialize(module, device, init)
    return check_initial_values(modules, notes, group, skip)


def _check_has_init_weights(model: nn.Module) -> None:
    if not callable(getattr(model, "init_weights", None)):
        raise ConfigError(
            f"to build on the meta device a model needs init_weights() to fill its parameters "
            f"(and buffers) after they are allocated; {type(model).__name__} has none. Add an "
            f"init_weights(self) method, or build the model on a real device instead"
        )


def tied_names(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings): each group in the order
    ``named_parameters`` meets them, so its first is the name one process saves and optimizes
    the parameter under."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


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


@dataclasses.dataclass(frozen=True)
class SetupBytes:
    """What building the model costs one rank before the first step: ``held``, the storage
    it keeps (its shards, or the whole model when built whole), and ``staging``, the largest
    full-size temporary :func:`materialize` draws at once (one module's own tensors at their
    whole shape, on the host: ``seeded_init``, GPT's ``init_weights``), from ``staging_module``."""

    held: int
    staging: int = 0
    staging_module: str = ""

    @property
    def peak(self) -> int:
        """Both at once (on a CPU rank they share one memory)."""
        return self.held + self.staging


def setup_bytes(modules: list[nn.Module], on_meta: bool, whole_bytes: int) -> SetupBytes:
    """:class:`SetupBytes` of this rank's ``modules`` (the model or its pipeline stages, the
    layout applied, still on meta): built on meta, the local parameters and buffers plus the
    largest module's whole own tensors; else ``whole_bytes``, the model every rank builds."""
    from meshtrain.observe.memory.zero_formulas import local_tensor

    if not on_meta:
        return SetupBytes(whole_bytes)
    seen, held, staging, where = set(), 0, 0, ""
    for module in modules:
        for name, sub in module.named_modules():
            own = [t for t in (*sub._parameters.values(), *sub._buffers.values())
                   if t is not None]
            fresh = [t for t in own if id(t) not in seen]
            seen.update(id(t) for t in fresh)
            held += sum(local_tensor(t).numel() * t.element_size() for t in fresh)
            full = sum(t.numel() * t.element_size() for t in own)
            if full > staging:
                staging, where = full, name
    return SetupBytes(held, staging, where)
