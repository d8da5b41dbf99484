"""Hugging Face causal LMs built sharded from the start: a factory whose model is built on the
meta device and initialised module by module, each module from its own seed, so that every
layout (one process, dp, zero3, tp...) gets the same values and a rank fills only its shards.

Transformers initialises a model with one pass over its modules drawing from the global random
stream, after the modules' own constructors have drawn from it too: a rank holding a shard could
only reproduce those values by generating the whole model's. Here each module's parameters are
instead drawn by the model class's own ``_init_weights`` (the same distributions: normal with
``initializer_range``, zero biases, unit norms, RoPE frequencies) from a generator seeded by
(seed, the module's name), on a full-size temporary copy of that one module; each rank keeps
its part. Peak memory: this rank's shards plus one module's full parameters.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class HFCausalLM:
    """A picklable factory: ``model_class(config)`` on the meta device, then (unless the caller
    builds on meta) allocated and filled by :func:`seeded_init`. meshtrain builds it sharded
    from the start under a sharded layout (``supports_sharded_init``). ``keep_attention``: the
    config's attention implementation as it is (else SDPA where the class has it)."""

    def __init__(self, model_class, config, seed: int = 0, keep_attention: bool = False):
        self.model_class, self.config, self.seed = model_class, config, seed
        self.keep_attention = keep_attention

    @property
    def supports_sharded_init(self) -> bool:
        """Built on meta under a sharded layout? Not when a module's ``_init_weights`` writes
        its children's tensors (GPT-2): such a model is built whole on every rank, with the
        same values. (Tied embeddings stay tied: ``materialize`` re-ties them.)"""
        if not hasattr(self, "_reaching"):
            with torch.device("meta"):
                self._reaching = seeded_init(self(), self.seed, dry_run=True)
        return not self._reaching

    def __call__(self) -> nn.Module:
        config = self.config
        if not getattr(self, "keep_attention", False):  # works on CPU, no flash attention
            config._attn_implementation = (
                "sdpa" if getattr(self.model_class, "_supports_sdpa", True) else "eager")
        with torch.device("meta"):
            model = self.model_class(config)
        if torch.get_default_device().type == "meta":  # the caller builds on meta
            return model
        model.to_empty(device=torch.get_default_device())
        model.tie_weights()  # to_empty gives tied parameters storage of their own
        self.init_weights(model)
        return model

    def init_weights(self, model: nn.Module) -> None:
        """Fill ``model``'s (possibly sharded) parameters and buffers: :func:`seeded_init`."""
        seeded_init(model, self.seed)


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s parameters (wrapper segments of the name ignored)."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, *, dry_run: bool = False,
                untouched: list | None = None) -> list[str]:
    """Initialise every parameter and buffer of ``model`` (a Hugging Face model, plain or with
    DTensor shards) module by module from :func:`module_seed`, with the model's own
    ``_init_weights``, children before their parent as Transformers does. Returns the modules
    whose ``_init_weights`` also writes their children's tensors (GPT-2's attention and MLP
    rescale their ``c_proj``): fine on whole tensors, refused on shards. A tensor that
    ``_init_weights`` leaves untouched is refused by name. ``dry_run`` (a meta-device model):
    only find those modules, and add to ``untouched`` the tensors (any dtype) no in-place
    write of ``_init_weights`` reached (their version counters did not move)."""
    from meshtrain.parallel.data.meta_init import copy_full_into

    initialise = getattr(model, "_init_weights", None)
    if not callable(initialise):
        raise ConfigError(f"{type(model).__name__} has no _init_weights: it is not a Hugging Face "
                          "model that HFCausalLM can initialise")
    reaching = []
    for name, module in _children_first(model):
        own = {**{n: t for n, t in module._parameters.items() if t is not None},
               **{n: t for n, t in module._buffers.items() if t is not None}}
        mine = {id(t) for t in own.values()}
        others = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in mine]
        versions = [t._version for t in others]
        split = _split_rows(module)  # under ep: {parameter: the rows of the whole it holds}
        full = {n: _blank(t, meta=dry_run, rows=module.whole_rows if n in split else None)
                for n, t in own.items()}
        before = {n: t._version for n, t in full.items()}
        saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
        try:
            for n in own:
                if n in module._parameters:
                    module._parameters[n] = nn.Parameter(full[n], requires_grad=False)
                else:
                    module._buffers[n] = full[n]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(seed, name))
                initialise(module)
        finally:
            module._parameters.update(saved_params)
            module._buffers.update(saved_buffers)
        if any(t._version != v for t, v in zip(others, versions)):
            reaching.append(name)
            if any(_is_sharded(t) for t in others):
                raise ConfigError(f"{type(model).__name__}._init_weights({name or 'the model'}) "
                                  "writes its submodules' tensors: it cannot be initialised "
                                  "shard by shard; build the model whole (meta_init=False)")
        if dry_run:
            if untouched is not None:
                untouched += [f"{name}.{n}" if name else n for n, t in full.items()
                              if t._version == before[n]]
            continue
        for n, tensor in own.items():
            if full[n].is_floating_point() and torch.isnan(full[n]).any():
                raise ConfigError(f"{type(model).__name__}._init_weights does not initialise "
                                  f"{name}.{n}; it cannot be built sharded from the start")
            copy_full_into(tensor, full[n], split.get(n))
    return reaching


def _split_rows(module: nn.Module) -> dict[str, slice]:
    """The parameters of an expert holder that ep split (meshtrain/parallel/expert/apply.py:
    each holds rows ``module.rows`` of a whole tensor of ``module.whole_rows`` rows), by name."""
    rows = getattr(module, "rows", None)
    if not isinstance(rows, slice) or getattr(module, "whole_rows", None) is None:
        return {}
    return {n: rows for n, p in module._parameters.items() if p is not None}


def _children_first(module: nn.Module, prefix: str = ""):
    """(name, module) of ``module``'s tree, each module after its children."""
    for child_name, child in module.named_children():
        yield from _children_first(child, f"{prefix}.{child_name}" if prefix else child_name)
    yield prefix, module


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _blank(tensor: torch.Tensor, meta: bool = False, rows: int | None = None) -> torch.Tensor:
    """A full-size CPU stand-in for ``tensor`` (its global shape if sharded; ``rows``: the
    whole tensor's first dimension, of which ep left ``tensor`` a slice): NaN where it is
    floating point, so that what no initialiser writes shows; an integer buffer keeps 0."""
    shape = tuple(tensor.shape) if rows is None else (rows, *tensor.shape[1:])
    blank = torch.empty(shape, dtype=tensor.dtype, device="meta" if meta else "cpu")
    if meta:
        return blank
    return blank.fill_(math.nan) if blank.is_floating_point() else blank.zero_()


def initialises_every_tensor(model: nn.Module) -> bool:
    """Does the model's own ``_init_weights`` write every parameter and buffer (a dry run on
    ``model``, a meta-device copy)? Only then can :class:`HFCausalLM` build it from a seed."""
    if not callable(getattr(model, "_init_weights", None)):
        return False
    untouched: list[str] = []
    try:
        seeded_init(model, 0, dry_run=True, untouched=untouched)
    except Exception:  # noqa: BLE001 -- an init that cannot run module by module
        return False
    return not untouched


def from_factory(factory, model: nn.Module | None, seed: int):
    """The factory meshtrain builds a Hugging Face model with when the user's ``factory``
    returns one (``model``: its meta-device copy): :class:`HFCausalLM` of its class and config,
    from the seed ``build_seeded`` marked on it or else ``seed``, so that every layout (one
    process included) starts from the same values and a splitting layout builds it sharded
    from the start. None (the user's factory as it is) for a model object, a factory that is
    already meshtrain's, a pretrained model (its config names a checkpoint: use init_from), or
    a model whose ``_init_weights`` leaves a tensor unwritten, or a factory that changed the
    model after building it (a dtype, frozen or added parameters, replaced modules: what it
    did would be lost)."""
    from meshtrain.models.hf import is_hf_model
    from meshtrain.parallel.data.meta_init import initializer_of

    if (isinstance(factory, nn.Module) or model is None or not is_hf_model(model)
            or initializer_of(factory) is not None
            or getattr(model.config, "_name_or_path", "")
            or not initialises_every_tensor(model)):
        return None
    try:
        with torch.device("meta"):
            fresh = type(model)(model.config)
    except Exception:  # noqa: BLE001 -- not rebuildable from its config
        return None
    if _structure(fresh) != _structure(model):
        return None
    return HFCausalLM(type(model), model.config, getattr(model, "_meshtrain_init_seed", seed),
                      keep_attention=True)


def _structure(model: nn.Module) -> tuple:
    """What a factory may change after construction: modules' types, tensors' shapes, dtypes
    and whether they train."""
    return (tuple((n, type(m)) for n, m in model.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in model.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()))
