"""The float8 runs of tests/test_float8.py and benchmarks/float8_numerics.py (torchao's
emulation, which runs on CPU): one job for the numerics against bf16, one for the layouts.

* Numerics: the 4-block tiny GPT of tests/parity.py learns targets (3 x + 1) mod 16 of random
  tokens (the loss falls from 2.79 to about 0.03 in 50 AdamW steps at lr 1e-2), one process.
* Layouts: the parity harness's 4-block tiny GPT, 8 SGD steps, in float64 (the model cast with
  ``.double()``): torchao computes the float8 matmul (emulated, as on hardware) in float32 with
  float32 scales, so a layout that splits a matmul (tp) lands float32 rounding away from one
  process (measured 2.5e-8), where an exact fp32 layout is 1e-16 away; in fp32 those last-bit
  differences flip float8 roundings of later layers and tp=2 lands 5.8e-5 away, as far as
  float8 itself is from fp32 (2.0e-4), so only float64 separates a layout bug from the format.
"""

from __future__ import annotations

import torch
from parity import GPT4_FNS, SEQ, VOCAB, lm_loss, sgd, tiny_gpt_4_layers
from torch.utils.data import TensorDataset

from meshtrain import Callback

EMULATED = dict(float8_emulate=True)
NUMERICS = dict(max_steps=50, global_batch_size=16, log_grad_norm=True)
LAYOUTS = dict(max_steps=8, global_batch_size=16, log_grad_norm=True)
FLOAT8_LAYERS = 24  # 4 blocks x (wq, wk, wv, wo, fc_in, fc_out); the head stays


def affine_tokens(seed: int = 5) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (96, SEQ), generator=gen)
    return TensorDataset(tokens, (3 * tokens + 1) % VOCAB)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


NUMERICS_FNS = dict(model_fn=tiny_gpt_4_layers, data_fn=affine_tokens, loss_fn=lm_loss,
                    optimizer_fn=adamw)
LAYOUT_FNS = dict(GPT4_FNS, optimizer_fn=sgd, float64=True)


class Float8Seen(Callback):
    """Fails the run at its start unless this rank's model holds ``layers`` float8 layers, with
    ``gathered_in_float8``: each float8 weight is torchao's FSDP2 float8 all-gather wrapper."""

    def __init__(self, layers: int, gathered_in_float8: bool = False):
        self.layers, self.gathered = layers, gathered_in_float8

    def on_fit_start(self, trainer) -> None:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        float8 = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
        assert len(float8) == self.layers, f"{len(float8)} float8 layers, not {self.layers}"
        if self.gathered:
            local = [getattr(m.weight, "_local_tensor", m.weight) for m in float8]
            assert all(isinstance(t, WeightWithDynamicFloat8CastTensor) for t in local), \
                {type(t).__name__ for t in local}


def loss_gap(run: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """How far one loss curve is from another: the largest |difference| over the steps as a
    fraction of the reference's first loss, and the mean of the last 10 losses relative to the
    reference's."""
    return dict(steps=((run - reference).abs().max() / reference[0]).item(),
                last10=(run[-10:].mean() / reference[-10:].mean() - 1).abs().item())
