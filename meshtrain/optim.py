"""Optimizer factories that see parameter names: AdamW with the usual weight-decay groups.

``fit(optimizer=...)`` takes a factory ``params -> Optimizer``. A factory marked with
``takes_names = True`` gets ``(name, parameter)`` pairs instead (full-model names, also under
FSDP, tensor and pipeline parallel and ZeRO-1), so it can group parameters by what they are::

    trainer.fit(model, data, optimizer=meshtrain.optim.AdamW(lr=3e-4, weight_decay=0.1))
"""

from __future__ import annotations

import torch

__all__ = ["AdamW"]

EMBEDDING_NAMES = ("embed", "wte.", "wpe.", "tok_emb.", "pos_emb.")


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: matrices of linear layers, not norms, biases (parameters
    of fewer than 2 dimensions) or embeddings (by name)."""
    return param.dim() >= 2 and not any(key in name for key in EMBEDDING_NAMES)


class AdamW:
    """``torch.optim.AdamW`` with two groups: ``weight_decay`` on the matrices of linear
    layers, none on norms, biases and embeddings (as GPT-2/Llama training does)."""

    takes_names = True

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, **options):
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, tuple(betas), eps
        self.options = options

    def __call__(self, named_params) -> torch.optim.AdamW:
        named_params = list(named_params)
        decay = [p for n, p in named_params if decays(n, p)]
        rest = [p for n, p in named_params if not decays(n, p)]
        groups = [g for g in ({"params": decay, "weight_decay": self.weight_decay},
                              {"params": rest, "weight_decay": 0.0}) if g["params"]]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps,
                                 **self.options)

    def __repr__(self) -> str:
        return (f"AdamW(lr={self.lr}, weight_decay={self.weight_decay} on matrices, "
                f"betas={self.betas})")


def params_factory(factory, model: torch.nn.Module):
    """``factory`` as a function of parameters alone: one marked ``takes_names`` gets each
    parameter's name in ``model`` (the zero1 wrapper hands it parameters only)."""
    if not getattr(factory, "takes_names", False):
        return factory
    names = {id(p): n for n, p in model.named_parameters()}
    return lambda params: factory([(names.get(id(p), ""), p) for p in params])
