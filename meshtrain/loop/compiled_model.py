"""A model given ``torch.compile``'d (``model = torch.compile(MyModel())``, then ``fit(model)``).

``torch.compile`` returns a wrapper (``OptimizedModule``) whose parameter names start with
``_orig_mod.``: trained as it is, its checkpoints did not load into the module itself (nor the
module's into it), a pipeline could not cut it (refused: "the stages would not compute its
forward") and plans naming the module's parts missed them. So, as Lightning does, meshtrain
trains the module it wraps and compiles that in place its own way, said at start: each
repeated block where the module has them (``compile=True``, what docs/compile.md advises:
one graph for all blocks, FSDP2's and checkpointing's hooks at its edges), else the whole
forward (``compile="model"``); ``Trainer(compile=...)`` given decides instead.
``torch.compile``'s own options (``mode``, ``backend``) are not carried over.
"""

from __future__ import annotations

import dataclasses

from meshtrain.errors import ConfigError


def is_compiled(model) -> bool:
    """Is ``model`` ``torch.compile``'s wrapper of a module? (torch._dynamo not imported)"""
    cls = type(model)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def unwrap_compiled(t, model):
    """The module to train: ``model`` itself, or the one a compiled ``model`` wraps (with
    ``t``'s compile setting set, when the user gave none). A factory returning a compiled
    module is refused before any process starts: its wrapper is built on every rank."""
    if not is_compiled(model):
        return model
    if "compile" not in t._given:
        from meshtrain.parallel.compile import check_toolchain
        from meshtrain.parallel.data.fully_shard import find_blocks

        has_blocks = t._settings["blocks"] is not None or bool(find_blocks(model._orig_mod))
        mode = "blocks" if has_blocks else "model"
        check_toolchain(t.device_type)
        t._settings["compile"] = True if mode == "blocks" else mode
        if t.parallel_options is not None:
            t.parallel_options = dataclasses.replace(t.parallel_options, compile=mode)
        t.loader_notes.append(
            f"model: given torch.compile'd: meshtrain trains the module it wraps and compiles "
            f"it in place (compile={t._settings['compile']!r}), so parameter names and "
            "checkpoints stay the module's (torch.compile's own options are not carried over: "
            "Trainer(compile=...) sets how)")
    return model._orig_mod


def refuse_compiled_factory(built) -> None:
    if is_compiled(built):
        raise ConfigError(
            "the model factory returns a torch.compile'd module; return the module itself and "
            "let the Trainer compile it (Trainer(compile=\"model\") for the whole forward, "
            "compile=True for each block), so parameter names and checkpoints stay the "
            "module's")
