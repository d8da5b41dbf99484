"""``torch.compile``: TorchDynamo captures the forward as graphs and Inductor fuses them into
kernels (Ansel et al., "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
Transformation and Graph Compilation", ASPLOS 2024).

Modes:

* ``"blocks"`` (or ``True``): each repeated block is compiled on its own, as torchtitan does.
  The blocks share their code, so one graph serves them all; the compile time stays that of one
  block however deep the model, and the hooks of activation checkpointing and FSDP2 stay at the
  blocks' edges, outside the graphs.
* ``"model"``: the whole model's forward in one graph (more fusion across the embedding and head,
  but compile time grows with depth, and under FSDP2 its per-block hooks split the graph).

Compilation is in place (``nn.Module.compile``): no ``_orig_mod`` enters any parameter name,
so checkpoints, optimizers and Hugging Face export see the same names as without it. It is
applied after tensor/context parallel and activation checkpointing and before DDP/FSDP2.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.errors import ConfigError

MODES = ("blocks", "model")


def compile_mode(value) -> str | None:
    """The setting's (already checked) value as a mode: ``True`` means ``"blocks"``;
    ``False``/``None`` off."""
    mode = "blocks" if value is True else (value or None)
    assert mode is None or mode in MODES, value
    return mode


def check_compile(mode: str | None, *, has_blocks: bool,
                  activation_checkpointing: str | None = None) -> None:
    """Refuse, before any process starts, what compile cannot do (every layout composes with it:
    tests/parallel/test_compile.py)."""
    if mode is None:
        return
    if mode == "model" and activation_checkpointing is not None:
        raise ConfigError(
            f"compile='model' with activation_checkpointing={activation_checkpointing!r} fails "
            "in backward in torch 2.13: the whole-model graph takes in the blocks' checkpoint "
            "hooks, and the recomputation no longer matches the forward; use compile=True "
            "(each block compiled, checkpointing around it) or activation_checkpointing=None"
        )
    if mode == "blocks" and not has_blocks:
        raise ConfigError(
            "compile='blocks' needs the model's repeated blocks (e.g. an nn.ModuleList of "
            "layers) and none were found; pass blocks=lambda model: [...] to the Trainer, or "
            "use compile='model'"
        )


def check_toolchain(device_type: str) -> None:
    """Inductor writes C++ for the CPU (and Triton for CUDA): is there a compiler to build it?"""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError("compile on CUDA needs Triton, which is not installed; install the "
                              "triton package that matches your torch, or set compile=False")
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, or a search that failed otherwise
        raise ConfigError(
            "compile on CPU needs a C++ compiler (Inductor builds its kernels with it) and none "
            f"was found ({type(error).__name__}: {error}); install g++ (e.g. apt install g++), set CXX, "
            "or set compile=False") from None


def _copy_views(module, args, kwargs):
    """Copy the tensor arguments that are views (eagerly, before the compiled graph): under tp a
    block's input may be ``DTensor.to_local()`` of the layer before (e.g. a Hugging Face model's
    vocabulary-parallel embedding), and a graph whose input aliases a DTensor's local tensor
    hands a plain tensor to DTensor's backward in torch 2.13 ("'Tensor' object has no attribute
    '_local_tensor'"). One copy of the hidden state per block call; blocks fed a fresh tensor
    copy nothing."""
    def fresh(value):
        if isinstance(value, torch.Tensor) and value._is_view():
            return value.clone()
        return value
    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def apply_compile(model: nn.Module, mode: str | None, blocks: list[nn.Module], *,
                  tensor_parallel: bool = False) -> None:
    """Compile ``model`` in place: each of ``blocks``, or the whole forward (``mode``).
    ``tensor_parallel``: the blocks hold DTensors (see ``_copy_views``)."""
    if mode is None:
        return
    if mode == "model":
        model.compile()
        return
    if not blocks:
        check_compile(mode, has_blocks=False)
    for block in blocks:
        if tensor_parallel:
            # (dynamo imported here, not with this module: it takes half a second)
            block.register_forward_pre_hook(torch._dynamo.disable(_copy_views), with_kwargs=True)
        block.compile()
