"""``meshtrain export CHECKPOINT --hf OUT_DIR``: a training checkpoint (DCP) as a Hugging Face
model folder (config.json + safetensors, tied copies left out as ``save_pretrained`` does) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Reading a folder into a layout is
meshtrain/checkpoint/hf_weights.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from meshtrain.checkpoint.hf_weights import (
    _TOKENIZER_FILES, SAFE_INDEX, SAFE_WEIGHTS, _clean, _few, _model_tensors,
)
from meshtrain.checkpoint.hf_experts import stored_apart
from meshtrain.checkpoint.safe_load import read_model_state
from meshtrain.errors import ConfigError


# --- What has no Hugging Face architecture -------------------------------------------------------
def _gpt_outer_names() -> set[str]:
    """The names of meshtrain's GPT outside its blocks (tok_emb.weight, pos_emb.weight,
    norm.weight, head.weight), from the class itself built on the meta device."""
    from meshtrain.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=2, seq_len=2, num_layers=1, num_heads=1, d_model=2,
                            bias=False))
    return {name for name in gpt.state_dict() if not name.startswith("layers.")}


def refuse_meshtrain_gpt(names, checkpoint_dir) -> None:
    """A ``ConfigError`` when the model names ``names`` of the checkpoint ``checkpoint_dir`` are
    meshtrain's own GPT's: it has no Hugging Face architecture (no config.json can describe
    it, transformers has no class that loads it); the message says which export works."""
    if not _gpt_outer_names() <= {_clean(name) for name in names}:
        return
    raise ConfigError(
        f"the checkpoint {checkpoint_dir} holds meshtrain's own GPT (meshtrain.models.gpt.GPT: "
        "tok_emb, pos_emb, layers, head), which has no Hugging Face architecture, so no "
        "config.json can describe it and transformers cannot load it. Export its weights as one "
        f"state_dict file instead: meshtrain export {checkpoint_dir} model.pt, then "
        "GPT(GPTConfig(...)).load_state_dict(torch.load('model.pt')) with the sizes it was "
        "trained with (a recipe run's config.toml: [model]). For a Hugging Face folder, train a "
        "Hugging Face architecture (the causal_lm recipe's model.architecture = \"llama\", "
        "\"qwen2\" or \"mistral\", or model.hf_config)")


# --- Writing a folder ---------------------------------------------------------------------------
def _resolve_config(config):
    """A ``PretrainedConfig`` from itself, a folder holding config.json, or a config.json file."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    path = Path(config)
    folder = path.parent if path.is_file() else path
    if not (folder / "config.json").is_file() or (path.is_file() and path.name != "config.json"):
        raise ConfigError(f"no Hugging Face config at {path}: pass a folder holding "
                          "config.json (or the config.json file itself)")
    return transformers.AutoConfig.from_pretrained(folder)


def _reference_names(config) -> tuple[dict[str, tuple[int, ...]], dict[str, str], object]:
    """The names and shapes a ``from_pretrained`` model of ``config`` expects, its tied copies
    (left out of the files, as ``save_pretrained`` does) -> the name they copy, and the model.
    Built on the meta device: nothing is allocated."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = {}
    for group in _model_tensors(model):
        for name in group[1:]:
            tied[name] = group[0]
    return shapes, tied, model


def _write_shards(state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """``state`` as safetensors shards of at most ``max_shard_bytes`` and their index. (DCP's
    ``HuggingFaceStorageWriter`` took 8.4x as long for the same files: benchmarks/hf_weights.py
    --export.)"""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for old in list(out_dir.glob("model*.safetensors")) + [out_dir / SAFE_INDEX]:
        old.unlink(missing_ok=True)  # a previous export's shards must not mix with these
    if len(shards) == 1:
        save_file(shards[0], out_dir / SAFE_WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values()),
                          "total_parameters": sum(t.numel() for t in state.values())},
             "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, config,
              tokenizer_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write the model weights of the training checkpoint ``checkpoint_dir`` as a Hugging Face
    folder ``out_dir``; return its path.

    ``config``: a ``transformers.PretrainedConfig`` or a folder (or file) holding config.json,
    the architecture the checkpoint was trained as. Written: ``config.json``, the weights as
    ``model.safetensors`` (or ``model-0000x-of-0000y.safetensors`` shards with an index when
    larger than ``max_shard_bytes``), tied copies left out (as ``save_pretrained`` does), and the
    tokenizer files of ``tokenizer_dir`` when given. ``dtype`` converts floating-point weights
    (and is recorded in config.json). Reads the checkpoint in this one process (no process
    group); the names and shapes are checked against ``config`` before anything is written
    (a checkpoint of meshtrain's own GPT, which no Hugging Face config describes, is refused
    saying which export works for it).
    """
    out_dir = Path(out_dir)
    config = _resolve_config(config)
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    state = {_clean(k): v for k, v in read_model_state(checkpoint_dir, dtype).items()}
    shapes, tied, reference = _reference_names(config)
    expected = set(shapes) - set(tied)
    missing = expected - set(state)
    extra = set(state) - set(shapes)
    arch = (config.architectures or [type(config).__name__])[0]
    if missing or extra:
        refuse_meshtrain_gpt(state, checkpoint_dir)
        raise ConfigError(
            f"the checkpoint {checkpoint_dir} does not match the config ({arch}): "
            + (f"missing {_few(missing)}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not in the config's model {_few(extra)}" if extra else "")
            + "; pass the config the model was trained with")
    for name in shapes:  # (in the model's order: the first mismatch is the telling one)
        if name in expected and tuple(state[name].shape) != shapes[name]:
            raise ConfigError(f"{name}: the checkpoint holds shape {tuple(state[name].shape)}, "
                              f"the config's model {shapes[name]} ({arch}); pass the config "
                              "the model was trained with")
    for name, source in tied.items():  # a tied copy that was trained apart is not a copy
        if name in state and source in state and not torch.equal(state[name], state[source]):
            raise ConfigError(
                f"the config ties {name} to {source} (tie_word_embeddings), but the checkpoint "
                "holds different values for them; pass a config with tie_word_embeddings=False")
    state = {name: state[name].contiguous() for name in shapes if name in expected}
    # fused experts written one by one, as save_pretrained writes them (hf_experts.py)
    state = stored_apart(state, reference)
    out_dir.mkdir(parents=True, exist_ok=True)
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    if floating:
        config.dtype = floating[0]
    config.save_pretrained(out_dir)
    _write_shards(state, out_dir, max_shard_bytes)
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        found = [tokenizer_dir / f for f in _TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
        if not found:
            raise ConfigError(f"no tokenizer files in {tokenizer_dir} (looked for "
                              f"{', '.join(_TOKENIZER_FILES[:4])}, ...)")
        for file in found:
            shutil.copy2(file, out_dir / file.name)
    return out_dir
