"""Hugging Face weights in and out of any meshtrain layout (optional extra ``meshtrain[hf]``).

:func:`load_hf_weights` copies a Hugging Face model folder (``config.json`` with
``model.safetensors``, or shards ``model-0000x-of-0000y.safetensors`` listed in
``model.safetensors.index.json``) into a model in place, whatever its layout: plain tensors, or
DTensors of any placement (FSDP2 ``Shard(0)``, tensor parallel ``Shard(0)``/``Shard(1)``,
``Replicate``, 2-D meshes with FSDP2's ``_StridedShard`` over tensor parallel). Each rank reads
only its own slice of every tensor from the files (``safe_open(...).get_slice``), so no rank
ever holds a full copy of a sharded weight. Call it on every rank; it runs no collective.

The other way, a training checkpoint written as such a folder: meshtrain/checkpoint/hf_export.py.

Why not DCP's ``HuggingFaceStorageReader``: it reads the same values but took 1.20x this
reader's time into FSDP2 shards (the same into tp shards), and matches names one to one, where
this one checks names and shapes first, follows transformers' renames, splits fused experts,
fills a tied head and a pipeline stage's part (benchmarks/hf_weights.py; benchmarks/README.md).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn as nn

from meshtrain.checkpoint.hf_experts import expert_rows, held_indices, owner_of, whole_shape
from meshtrain.errors import ConfigError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# name components of wrappers that are not part of the Hugging Face names
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                    "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")
_SHOWN = 5  # names listed in an error


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("Hugging Face weights need safetensors: pip install 'meshtrain[hf]'") \
            from exc
    return safe_open


def _few(names) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


# --- Reading a folder ---------------------------------------------------------------------------
def weight_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``folder`` that holds it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"Hugging Face model folder {folder} does not exist (or is not a "
                          "folder); pass a folder holding config.json and model.safetensors")
    index = folder / SAFE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map'; is it a safetensors index?")
        files = {name: folder / file for name, file in weight_map.items()}
        absent = {str(f.name) for f in files.values() if not f.is_file()}
        if absent:
            raise ConfigError(f"{index} lists files that are not in {folder}: {_few(absent)}")
        return files
    single = folder / SAFE_WEIGHTS
    if single.is_file():
        with _safe_open()(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in folder.iterdir())
    raise ConfigError(
        f"{folder} holds no {SAFE_WEIGHTS} nor {SAFE_INDEX} (found: {_few(found) or 'nothing'}); "
        "meshtrain reads Hugging Face weights in safetensors format only (re-save a "
        "pytorch_model.bin folder with save_pretrained(safe_serialization=True))"
    )


def _folder_config(folder: Path) -> dict:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _model_tensors(model: nn.Module) -> list[list[str]]:
    """The model's parameters and persistent buffers as groups of names that share one tensor
    (tied weights), in module order, names without wrapper components."""
    groups: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        entries = list(module._parameters.items())
        entries += [(n, b) for n, b in module._buffers.items()
                    if n not in module._non_persistent_buffers_set]
        for name, tensor in entries:
            if tensor is None:
                continue
            names = groups.setdefault(id(tensor), [])
            full = _clean(prefix + name)
            if full not in names:
                names.append(full)
    return list(groups.values())


def _tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                out.setdefault(_clean(prefix + name), tensor)
    return out


def _input_embedding_names(model: nn.Module, files: dict[str, Path]) -> list[str]:
    """Where a tied output embedding's weight lives in the file (the input embedding)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if embedding is not None:
        for name, module in model.named_modules(remove_duplicate=False):
            if module is embedding:
                return [_clean(f"{name}.weight" if name else "weight")]
    # a pipeline stage without the embedding: the file's input embedding under a common name
    return [n for n in files if n.endswith(("embed_tokens.weight", "wte.weight", "embed_in.weight",
                                            "word_embeddings.weight"))]


def _local_indices(tensor) -> list[torch.Tensor | None]:
    """Per dim, the global indices of this rank's local elements (None: the whole dim)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import (
        _StridedShard,
        _StridedShardOffsetMode,
    )

    indices: list[torch.Tensor | None] = [None] * tensor.dim()
    if not isinstance(tensor, DTensor):
        return indices
    mesh, shape = tensor.device_mesh, tensor.shape
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not part of this tensor's mesh: nothing local
        return [torch.arange(0) for _ in shape]
    # left to right, as torch's compute_local_shape_and_global_offset does (FSDP2 over tensor
    # parallel gives (_StridedShard(0, sf=tp), Shard(0)): the strided split comes first)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            dim = placement.dim
            current = indices[dim] if indices[dim] is not None else torch.arange(shape[dim])
            size, offsets = placement._local_shard_size_and_offset(
                len(current), mesh.size(mesh_dim), coordinate[mesh_dim],
                offset_mode=_StridedShardOffsetMode.ALL)
            picked = torch.tensor(list(offsets or [])[:size], dtype=torch.long)
        elif isinstance(placement, Shard):
            dim = placement.dim
            current = indices[dim] if indices[dim] is not None else torch.arange(shape[dim])
            size, offset = Shard.local_shard_size_and_offset(
                len(current), mesh.size(mesh_dim), coordinate[mesh_dim])
            picked = torch.arange(offset, offset + size) if size else torch.arange(0)
        else:  # Replicate (Partial parameters do not occur)
            continue
        indices[dim] = current[picked]
    return indices


def _read_local(handle, name: str, indices: list[torch.Tensor | None]) -> torch.Tensor:
    """This rank's part of ``name``: one contiguous slab of the file per dim (only its bytes are
    read), then, if the rank's indices are not a contiguous range, a gather within the slab."""
    part = handle.get_slice(name)
    slices, picks = [], []
    for dim, index in enumerate(indices):
        if index is None:
            slices.append(slice(None))
            picks.append(None)
        elif index.numel() == 0:
            slices.append(slice(0, 0))
            picks.append(None)
        else:
            low, high = int(index.min()), int(index.max()) + 1
            slices.append(slice(low, high))
            contiguous = high - low == index.numel() and bool((index.diff() == 1).all())
            picks.append(None if contiguous else (dim, index - low))
    tensor = part[tuple(slices)] if slices else part[:]
    for pick in picks:
        if pick is not None:
            tensor = tensor.index_select(pick[0], pick[1])
    return tensor


def _config_hint(folder_config: dict, model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None or not folder_config:
        return ""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer",
            "n_head", "n_positions")
    diffs = [f"{k}={folder_config[k]} (model: {getattr(config, k)})" for k in keys
             if k in folder_config and getattr(config, k, None) not in (None, folder_config[k])]
    return f"; the folder's config.json has {', '.join(diffs)}" if diffs else ""


def load_hf_weights(model: nn.Module, folder: str | os.PathLike, *,
                    partial: bool = False) -> dict:
    """Copy the weights of the Hugging Face model folder ``folder`` into ``model`` in place.

    ``model``'s parameters and buffers may be plain tensors or DTensors of any placement; each
    rank reads only its local slice of each tensor. Every parameter and persistent buffer of
    ``model`` must be in the files (a tied output embedding, e.g. ``lm_head.weight`` when the
    folder's config has ``tie_word_embeddings``, is read from the input embedding). Entries of
    the files that the model lacks are an error, unless ``partial=True`` (a pipeline stage,
    which holds only its own layers, under the full model's names). Values are converted to
    each tensor's dtype. Raises ``ConfigError`` for missing files, missing or extra names and
    shape mismatches before anything is copied.

    Returns ``{"tensors": loaded, "bytes_read": bytes read on this rank, "bytes_total": bytes
    of those tensors in the files, "files": files opened}``.
    """
    folder = Path(folder)
    files = weight_files(folder)
    folder_config = _folder_config(folder)
    groups = _model_tensors(model)
    tensors = _tensors_by_name(model)
    tied_ok = folder_config.get(
        "tie_word_embeddings", getattr(getattr(model, "config", None), "tie_word_embeddings", False))

    sources: list[tuple[str, list[str]]] = []  # (file name to read, model names it fills)
    missing = []
    renamed = {}  # model name -> file name, where transformers' conversion mapping renames
    if not all(n in files for names in groups for n in names[:1]):
        from meshtrain.checkpoint.hf_experts import renamed_in_folder

        renamed = renamed_in_folder(model, files)
    for names in groups:
        source = next((n for n in names if n in files), None) or next(
            (renamed[n] for n in names if n in renamed), None)
        if source is None and tied_ok and any(n.endswith("lm_head.weight") for n in names):
            source = next((n for n in _input_embedding_names(model, files) if n in files), None)
        if source is None:
            missing += names[:1]
        else:
            sources.append((source, names))
    fused = {}
    if missing:  # fused experts the folder stores one by one (hf_experts.py)
        from meshtrain.checkpoint.hf_experts import fused_in_folder

        apart = fused_in_folder(model, files)
        fused = {name: apart[name] for name in missing if name in apart}
        missing = [name for name in missing if name not in fused]
    if missing:
        raise ConfigError(
            f"{len(missing)} tensors of {type(model).__name__} are not in {folder}: "
            f"{_few(missing)}; is the folder a checkpoint of this architecture"
            f"{_config_hint(folder_config, model) or ''}?"
        )
    used = {source for source, _ in sources} | {n for _, names in sources for n in names} | {
        key for f in fused.values() for part in f.parts for key in part.values()}
    extra = set(files) - used
    if extra and not partial:
        raise ConfigError(
            f"{len(extra)} tensors of {folder} are not in {type(model).__name__}: {_few(extra)}"
            f"{_config_hint(folder_config, model)}; on a pipeline stage (which holds only its "
            "own layers) pass partial=True"
        )

    safe_open = _safe_open()
    report = {"tensors": 0, "bytes_read": 0, "bytes_total": 0, "files": []}
    if fused:  # (shapes first: a mismatch must not leave a half-loaded model)
        _load_fused(model, tensors, fused, files, safe_open, None)
    by_file: dict[Path, list[tuple[str, list[str]]]] = {}
    for source, names in sources:
        by_file.setdefault(files[source], []).append((source, names))
    # check every shape first: a mismatch must not leave a half-loaded model
    handles = {path: safe_open(path, framework="pt") for path in by_file}
    try:
        for path, entries in by_file.items():
            for source, names in entries:
                target = tensors[names[0]]
                shape = tuple(handles[path].get_slice(source).get_shape())
                if shape != whole_shape(model, names[0], target):
                    raise ConfigError(
                        f"{names[0]}: {folder} holds shape {shape} ({source} in {path.name}), "
                        f"the model {whole_shape(model, names[0], target)}"
                        f"{_config_hint(folder_config, model)}")
                if target.device.type == "meta":
                    raise ConfigError(
                        f"{names[0]} is on the meta device; materialize the model first "
                        "(to_empty) and then load the weights into it")
        with torch.no_grad():
            for path, entries in by_file.items():
                report["files"].append(path.name)
                for source, names in entries:
                    target = tensors[names[0]]
                    local = target.to_local() if hasattr(target, "to_local") else target
                    part = _read_local(handles[path], source,
                                       held_indices(model, names[0], target))
                    if tuple(part.shape) != tuple(local.shape):  # (an unknown placement)
                        raise ConfigError(
                            f"{names[0]}: computed a local slice of shape {tuple(part.shape)} "
                            f"but this rank holds {tuple(local.shape)} "
                            f"(placements {getattr(target, 'placements', None)})")
                    report["bytes_read"] += part.numel() * part.element_size()
                    report["bytes_total"] += math.prod(target.shape) * part.element_size()
                    local.copy_(part.to(local.dtype))
                    report["tensors"] += 1
    finally:
        for handle in handles.values():
            if hasattr(handle, "__exit__"):
                handle.__exit__(None, None, None)
    if fused:
        _load_fused(model, tensors, fused, files, safe_open, report)
    return report


def _load_fused(model: nn.Module, tensors: dict, fused: dict, files: dict, safe_open,
                report: dict | None) -> None:
    """Each fused expert tensor's local rows, read expert by expert from the files that store
    them apart (hf_experts.py): the experts of this rank's rows only. ``report`` None: check
    the shapes (the files' metadata) and copy nothing."""
    from meshtrain.checkpoint.hf_experts import read_fused

    handles: dict = {}

    def handle(key: str):
        if files[key] not in handles:
            handles[files[key]] = safe_open(files[key], framework="pt")
        return handles[files[key]].get_slice(key)

    def read(key: str) -> torch.Tensor:
        part = handle(key)[:]
        report["bytes_read"] += part.numel() * part.element_size()
        return part

    def shape_of(key: str) -> torch.Tensor:  # (an empty stand-in: shapes only)
        return torch.empty(tuple(handle(key).get_shape()), device="meta")

    try:
        for name, source in fused.items():
            target = tensors[name]
            indices = _local_indices(target)
            owner = owner_of(model, name)
            ep = getattr(owner, "ep_mesh", None)  # (under ep: this rank's rows of the whole)
            whole = target.shape[0] * (ep.size() if ep is not None else 1)
            if source.num_experts != whole or any(i is not None for i in indices[1:]):
                raise ConfigError(
                    f"{name}: the folder holds {source.num_experts} experts stored apart, the "
                    f"model {whole} (placements {getattr(target, 'placements', None)}; "
                    "meshtrain reads fused experts split by expert only)")
            rows = expert_rows(model, name, indices[0]).tolist()
            local = target.to_local() if hasattr(target, "to_local") else target
            part = read_fused(source, read if report is not None else shape_of, rows)
            if tuple(part.shape) != tuple(local.shape):
                raise ConfigError(f"{name}: the folder's experts make shape "
                                  f"{tuple(part.shape)} here, this rank holds "
                                  f"{tuple(local.shape)}")
            if report is None:
                continue
            with torch.no_grad():
                local.copy_(part.to(local.dtype))
            per_expert = part.numel() // max(len(rows), 1) * part.element_size()
            report["bytes_total"] += source.num_experts * per_expert
            report["tensors"] += 1
    finally:
        for opened in handles.values():
            if hasattr(opened, "__exit__"):
                opened.__exit__(None, None, None)
