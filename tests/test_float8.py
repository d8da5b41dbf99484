"""float8 training through torchao (``float8=``): which layers it swaps, its numerics against
bf16 over 50 steps, zero3=2 and tp=2 against one process, compile, and the refusals before
start where the hardware has no float8 matmuls. The CPU tests run torchao's emulation
(``float8_emulate=True``); the ``gpu`` test runs real float8 on a GPU of capability >= 8.9.

Bounds, measured by ``python benchmarks/float8_numerics.py`` (docs/precision.md):

* Numerics (float8 + bf16-mixed against bf16-mixed, 50 AdamW steps, tests/float8_job.py): the
  largest loss difference over the steps 0.30 % (tensorwise) and 0.66 % (rowwise) of the first
  loss, the last 10 steps' mean loss 2.2 % and 4.7 % off; allowed 2 % and 10 %. A run that left
  out float8 would equal bf16, so the curves must also differ (by 0.008-0.018 here).
* Layouts (float64, 8 SGD steps): zero3=2 against one process on its micro-batches (the float8
  input scale is per forward pass) 0 difference; tp=2 against one process 2.5e-8 (parameters),
  float32 rounding of torchao's float8 matmul. Allowed 1e-6: float8 itself moves the parameters
  1.6e-4 from fp32, so a layout that lost or mis-scaled float8 is caught.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn as nn
from float8_job import (
    EMULATED, FLOAT8_LAYERS, LAYOUT_FNS, LAYOUTS, NUMERICS, NUMERICS_FNS, Float8Seen, loss_gap,
)
from parity import GRAD_NORMS, LOSSES, params_of, run_ranks, tiny_gpt_4_layers, train_state

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.parallel.float8 import apply_float8, check_float8, float8_layers, float8_tp_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# -- which layers ---------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24: not a multiple of 16
        self.down = nn.Linear(24, 32)
        self.inner = nn.Sequential(nn.Linear(32, 32))
        self.head = nn.Linear(32, 16)  # the output head

    def forward(self, x):
        return self.head(self.inner(self.down(self.odd(self.up(x)))))


def test_the_eligible_linears_are_swapped_and_the_head_and_odd_sizes_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = Net()
    assert apply_float8(model, "tensorwise", emulate=True, sharded=False) == ["up", "inner.0"]
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == ["up",
                                                                                   "inner.0"]
    assert type(model.head) is nn.Linear and type(model.odd) is nn.Linear
    model(torch.randn(4, 32)).sum().backward()  # emulated: runs on CPU
    assert model.up.weight.grad is not None
    gpt = float8_layers(tiny_gpt_4_layers())
    assert len(gpt) == FLOAT8_LAYERS and "head" not in gpt and "layers.3.mlp.fc_out" in gpt


def test_tensorwise_tp_gives_the_float8_layers_torchaos_styles_with_the_same_layouts():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    class OwnStyle(ColwiseParallel):  # a style with a behaviour of its own: kept
        pass

    model = tiny_gpt_4_layers()
    plan = model.tp_plan(2, sequence_parallel=True, loss_parallel=False)
    plan["layers.3.mlp.fc_in"] = OwnStyle()
    apply_float8(model, "tensorwise", emulate=True, sharded=False)
    styles = float8_tp_plan(model, plan)
    assert type(styles["layers.0.attn.wq"]) is Float8ColwiseParallel
    fc_in, wo = styles["layers.2.mlp.fc_in"], styles["layers.1.attn.wo"]
    assert type(fc_in) is Float8ColwiseParallel and fc_in.input_layouts == (Shard(1),)
    assert type(wo) is Float8RowwiseParallel and wo.output_layouts == (Shard(1),)
    assert styles["head"] is plan["head"] and styles["layers.0.attn"] is plan["layers.0.attn"]
    assert styles["layers.3.mlp.fc_in"] is plan["layers.3.mlp.fc_in"]
    assert fc_in.desired_input_layouts == (Replicate(),)


# -- numerics against bf16 --------------------------------------------------------------------
@functools.cache
def bf16_run() -> dict:
    return train_state(dict(NUMERICS, precision="bf16-mixed"), **NUMERICS_FNS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_as_bf16_does_over_50_steps(recipe):
    bf16 = bf16_run()
    run = train_state(dict(NUMERICS, precision="bf16-mixed", float8=recipe, **EMULATED,
                           callbacks=[Float8Seen(FLOAT8_LAYERS)]), **NUMERICS_FNS)
    assert run[LOSSES][-10:].mean() < 0.05 * run[LOSSES][0]  # it learned the task
    gap = loss_gap(run[LOSSES], bf16[LOSSES])
    assert gap["steps"] <= 0.02 and gap["last10"] <= 0.10, gap
    assert (run[LOSSES] - bf16[LOSSES]).abs().max() > 1e-3  # float8 ran: not bf16's curve


# -- layouts against one process --------------------------------------------------------------
@functools.cache
def one_process(micro_batch_size: int | None) -> dict:
    return run_ranks(dict(LAYOUTS, float8="tensorwise", **EMULATED,
                          micro_batch_size=micro_batch_size), 1, **LAYOUT_FNS)[0]


def assert_close(ranks: list[dict], reference: dict, tol: float, label: str) -> None:
    for rank, state in enumerate(ranks):
        got = dict(
            param=max((v - reference[k]).abs().max().item()
                      for k, v in params_of(state).items()),
            loss=(state[LOSSES] - reference[LOSSES]).abs().max().item(),
            norm=(state[GRAD_NORMS] - reference[GRAD_NORMS]).abs().max().item())
        assert max(got.values()) <= tol, f"{label}, rank {rank}: {got}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout, micro_batch_size, gathered", [
    ("zero3=2", 8, True),  # 8 samples per forward pass on each rank: the same in one process
    ("tp=2", None, False),
])
def test_float8_layout_matches_one_process_under_float8(layout, micro_batch_size, gathered):
    ranks = run_ranks(dict(LAYOUTS, layout=layout, float8="tensorwise", **EMULATED,
                           callbacks=[Float8Seen(FLOAT8_LAYERS, gathered)]), 2, **LAYOUT_FNS)
    reference = one_process(micro_batch_size)
    assert_close(ranks, reference, 1e-6, layout)


@pytest.mark.timeout(300)
def test_float8_compiled_trains_as_eager_float8():
    runs = [train_state(dict(LAYOUTS, max_steps=2, float8="tensorwise", **EMULATED,
                             compile=compiled, callbacks=[Float8Seen(FLOAT8_LAYERS)]),
                        **LAYOUT_FNS) for compiled in (False, True)]
    assert_close(runs[1:], runs[0], 1e-6, "compile=True")


# -- refused before start -----------------------------------------------------------------------
def test_float8_without_float8_hardware_is_refused_before_start(monkeypatch):
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9.*float8_emulate=True"):
        Trainer(float8="tensorwise", accelerator="cpu", max_steps=1)
    # a CUDA GPU below 8.9 (an A100: 8.0), simulated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"GPU 0 \(NVIDIA A100-SXM4-80GB\) has 8\.0"):
        Trainer(float8="rowwise", accelerator="cuda", max_steps=1)
    check_float8("rowwise", True, "cuda", "bf16-mixed")  # emulated: anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))  # an H100
    check_float8("rowwise", False, "cuda", "bf16-mixed")


def test_float8_settings_that_cannot_run_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="fp16-mixed"):
        Trainer(float8="tensorwise", float8_emulate=True, precision="fp16-mixed", max_steps=1)
    with pytest.raises(ConfigError, match="float8_emulate is used with float8 only"):
        Trainer(float8_emulate=True, max_steps=1)
    with pytest.raises(ConfigError, match=r"would change nothing.*0 \(12x24\)"):  # (meta copy)
        Trainer(float8="tensorwise", float8_emulate=True, max_steps=1, global_batch_size=8,
                loggers=(),
                progress_bar=False, report=False).fit(
            lambda: nn.Sequential(nn.Linear(12, 24), nn.Linear(24, 3)),
            [(torch.randn(12), torch.randn(3))] * 8, loss_fn=nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'meshtrain\[float8\]'"):
        Trainer(float8="tensorwise", float8_emulate=True, max_steps=1)


# -- a GPU with float8 ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability >= 8.9 (H100, L4, ...)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_float8_on_a_gpu_trains_as_its_emulation(recipe):
    common = dict(NUMERICS, accelerator="cuda", precision="bf16-mixed", float8=recipe,
                  callbacks=[Float8Seen(FLOAT8_LAYERS)])
    real = train_state(common, **NUMERICS_FNS)
    emulated = train_state(dict(common, **EMULATED), **NUMERICS_FNS)
    assert real[LOSSES][-10:].mean() < 0.05 * real[LOSSES][0]
    # the same casts and scales; _scaled_mm's accumulation order is the difference
    gap = loss_gap(real[LOSSES], emulated[LOSSES])
    assert gap["steps"] <= 0.02 and gap["last10"] <= 0.10, gap
