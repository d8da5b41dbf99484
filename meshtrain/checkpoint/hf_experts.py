"""A transformers MoE model's fused experts in a folder that stores each expert apart.

transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]) but ``save_pretrained`` writes, and the hub's checkpoints hold, one
tensor per expert and projection (``mlp.experts.3.gate_proj.weight``; Mixtral:
``block_sparse_moe.experts.3.w1.weight``). The model's own conversion mapping
(``transformers.conversion_mapping``: renamings, then a converter that stacks the experts,
``MergeModulelist(dim=0)``, and concatenates the projections, ``Concatenate(dim=1)``) says
which file tensors make which fused tensor. meshtrain follows it both ways:

* reading (``load_hf_weights``): each rank reads only the experts of its rows (under ep its
  own experts; under FSDP2 its shard's) and builds its part of the fused tensor; other
  tensors the mapping renames are read under their files' names;
* writing (``export_hf``): the fused tensors are cut back into the files' per-expert tensors,
  under the names the mapping's reverse gives, so that the export equals what
  ``save_pretrained`` writes.

Only those two operations are followed; a model whose mapping does something else to its
experts is refused, naming the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError


@dataclass
class Fused:
    """A fused model tensor and the file tensors it is made of: ``parts[i][e]`` the file name of
    expert e for the converter's i-th source pattern (gate, up, ...), concatenated along
    ``concat_dim`` (None: one pattern, the experts stacked only)."""

    name: str
    parts: list[dict[int, str]] = field(default_factory=list)
    concat_dim: int | None = None

    @property
    def num_experts(self) -> int:
        return len(self.parts[0]) if self.parts else 0


def _mapping(model):
    """(renamings, converters) of the model's transformers conversion mapping, or None."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # pragma: no cover - an older transformers: no fused experts either
        return None
    mapping = get_model_conversion_mapping(model)
    return ([t for t in mapping if isinstance(t, WeightRenaming)],
            [t for t in mapping if isinstance(t, WeightConverter)])


def _concat_dim(converter, name: str) -> int | None:
    """The Concatenate dim after MergeModulelist(dim=0); refused for other operations."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1:
            return None
        if len(ops) == 2 and isinstance(ops[1], Concatenate):
            return ops[1].dim
    raise ConfigError(
        f"{name} is made from the folder's tensors by {[type(op).__name__ for op in ops]} "
        "(transformers' conversion mapping); meshtrain follows only stacking the experts and "
        "concatenating their projections")


def fused_in_folder(model, file_names) -> dict[str, Fused]:
    """{model tensor name: Fused} for the model's tensors the folder stores apart."""
    mapping = _mapping(model)
    if mapping is None:
        return {}
    from transformers.core_model_loading import apply_renamings, rename_source_key

    renamings, converters = mapping
    found: dict[str, Fused] = {}
    for file_name in file_names:
        name, pattern = rename_source_key(file_name, renamings, converters)
        if pattern is None:
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        original = converter._original_source_patterns[converter.source_patterns.index(pattern)]
        before = original.split("*")[0].lstrip(".")  # the expert's number stands for the *
        number = re.search(re.escape(before) + r"(\d+)", apply_renamings(file_name, renamings))
        if number is None:
            continue
        fused = found.get(name)
        if fused is None:
            fused = found[name] = Fused(name, [{} for _ in converter.source_patterns],
                                        _concat_dim(converter, name))
        fused.parts[converter.source_patterns.index(pattern)][int(number.group(1))] = file_name
    return found


def renamed_in_folder(model, file_names) -> dict[str, str]:
    """{model tensor name: file name} for the files' tensors the model's conversion mapping
    renames (e.g. Mixtral's ``block_sparse_moe.gate`` -> ``mlp.gate``)."""
    mapping = _mapping(model)
    if mapping is None:
        return {}
    from transformers.core_model_loading import apply_renamings

    renamed = {apply_renamings(name, mapping[0]): name for name in file_names}
    return {new: old for new, old in renamed.items() if new != old}


def read_fused(fused: Fused, read, rows) -> torch.Tensor:
    """This rank's rows (experts, a list of indices) of ``fused``, each expert's parts read by
    ``read(file name)``."""
    experts = []
    for e in rows:
        parts = [read(part[e]) for part in fused.parts]
        experts.append(parts[0] if fused.concat_dim is None else
                       torch.cat(parts, dim=fused.concat_dim - 1))
    return torch.stack(experts)


def stored_apart(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """``state`` (model names, fused experts) with every fused tensor the model's conversion
    mapping makes from per-expert file tensors cut back into them, under the files' names."""
    mapping = _mapping(model)
    if mapping is None:
        return state
    from transformers.core_model_loading import apply_renamings

    renamings, converters = mapping
    reverse = [r.reverse_transform() for r in renamings][::-1]
    out = {}
    for name, tensor in state.items():
        converter, target = _converter_of(name, converters)
        if converter is None:  # (renamed back all the same: Mixtral's router, block_sparse_moe)
            out[apply_renamings(name, reverse)] = tensor
            continue
        concat = _concat_dim(converter, name)
        prefix = name[:len(name) - len(target)]
        patterns = converter._original_source_patterns
        pieces = (tensor.chunk(len(patterns), dim=concat) if concat is not None else (tensor,))
        for pattern, piece in zip(patterns, pieces):
            for e, expert in enumerate(piece.unbind(0)):
                out[apply_renamings(_join(prefix, pattern, e), reverse)] = expert.contiguous()
    return out


def _join(prefix: str, pattern: str, expert: int) -> str:
    """The model-space name of ``pattern``'s tensor of ``expert`` under ``prefix`` (which ends
    where the converter's target began)."""
    tail = pattern.replace("*", str(expert))
    if prefix.endswith(".") and tail.startswith("."):
        tail = tail[1:]
    elif not prefix.endswith(".") and not tail.startswith(".") and prefix:
        tail = "." + tail
    return prefix + tail


def _converter_of(name: str, converters):
    """The converter whose target ``name`` ends with, and that target, or (None, None)."""
    for converter in converters:
        for target in converter._original_target_patterns:
            if "*" not in target and name.endswith(target):
                return converter, target
    return None, None


# --- which rows of a whole tensor this rank holds under ep ---------------------------------
def owner_of(model: nn.Module, name: str) -> nn.Module:
    """The module holding tensor ``name`` (a name without wrappers' parts: ``_clean``)."""
    from meshtrain.checkpoint.hf_weights import _clean

    prefix = name.rpartition(".")[0]
    try:
        return model.get_submodule(prefix)
    except AttributeError:  # (under a wrapper: activation checkpointing, compile)
        return next(m for n, m in model.named_modules() if _clean(n) == prefix)


def ep_share(model: nn.Module, name: str):
    """The ep mesh of the module owning ``name`` when ep split its rows (else None)."""
    module = owner_of(model, name)
    return getattr(module, "ep_mesh", None) if getattr(module, "rows", None) is not None \
        else None


def whole_shape(model: nn.Module, name: str, target) -> tuple[int, ...]:
    """The shape of ``name`` in one process's model: under ep the experts of every rank."""
    shape = list(target.shape)
    ep = ep_share(model, name)
    if ep is not None:
        shape[0] *= ep.size()
    return tuple(shape)


def held_indices(model: nn.Module, name: str, target) -> list:
    """Per dim, the indices of the whole tensor this rank holds (None: the whole dim): a
    DTensor's local elements, under ep among this rank's experts (a folder that stores the
    experts fused, as GPT-OSS does)."""
    from meshtrain.checkpoint.hf_weights import _local_indices

    indices = _local_indices(target)
    if ep_share(model, name) is not None:
        indices[0] = expert_rows(model, name, indices[0])
    return indices


def expert_rows(model: nn.Module, name: str, index) -> torch.Tensor:
    """The experts (dim-0 rows) of ``name`` this rank holds: under ep the owning module's
    ``rows`` (FSDP-sharded over edp: the DTensor's local rows of those), else a DTensor's
    local rows, else all of them."""
    module = owner_of(model, name)
    rows = getattr(module, "rows", None)
    if index is not None:  # (it failed before: rows of the ep share read as the whole's)
        return index + rows.start if rows is not None else index
    total = getattr(model.get_parameter(name), "shape", (0,))[0] if rows is None else None
    return torch.arange(rows.start, rows.stop) if rows is not None else torch.arange(total)
