"""fp16-mixed and bf16-mixed under dp, zero3 and pp against one process (the 4-block tiny GPT).

Each layout's run (2 ranks, 8 SGD steps) is compared with

* fp32 in one process: what the format costs plus what the layout adds;
* the same precision in one process on the layout's micro-batches (8 samples per forward pass,
  2 per step): what the layout alone adds. (Against whole batches of 16 the difference is as
  large as the format's: a half-precision weight gradient is rounded per micro-batch.)

The tolerances are fractions of the format's unit roundoff u (bf16: 8 significant bits, u = 2^-8;
fp16: 11 bits, u = 2^-11), measured by benchmarks/precision_parity.py (docs/precision.md): both
formats land at the same fractions of their u, at most 0.023 u for the parameters and losses and
0.115 u for the gradient norm against fp32, so each limit leaves a factor 2.2-2.8 over what was
measured. SGD keeps a parameter difference proportional to the gradient error (AdamW moves an
element with a near-zero gradient by about lr whatever the noise). The fp16 runs must skip no
step: a skipped step's gradient norm is inf and fails the comparison.

The overflow test puts an inf into one gradient on one pipeline rank: every rank must skip that
step and halve its scale alike (torch's grad scaler checks only the gradients a rank holds).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from parity import GPT4_FNS, GRAD_NORMS, LOSSES, compare_ranks, params_of, run_ranks, sgd

from meshtrain import Callback

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FNS = dict(GPT4_FNS, optimizer_fn=sgd)
COMMON = dict(max_steps=8, global_batch_size=16, log_grad_norm=True)
UNIT_ROUNDOFF = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}


def limits(precision: str, layout: str | None = None) -> dict[str, float]:
    """Largest |dparam|, |dloss| and |dgrad-norm| / max(norm, 1) allowed: against fp32 one
    process (``layout`` None), or a layout against the same precision in one process, which for
    dp and pp (the same arithmetic, other summation order) is tighter. zero3 casts the
    parameters to half precision once (FSDP2's ``param_dtype``) where autocast casts per
    operation and keeps norms and losses in fp32: as far from autocast as fp32 is."""
    u = UNIT_ROUNDOFF[precision]
    if layout in ("dp=2", "pp=2"):
        return dict(param=u / 32, loss=u / 32, norm=u / 32)
    return dict(param=u / 16, loss=u / 16, norm=u / 4)


def deviation(state: dict, reference: dict) -> dict[str, float]:
    """max |dparam| (over the parameters ``state`` holds), |dloss|, |dnorm| / max(norm, 1)."""
    want = reference[GRAD_NORMS]
    return dict(
        param=max((v.double() - reference[k].double()).abs().max().item()
                  for k, v in params_of(state).items()),
        loss=(state[LOSSES] - reference[LOSSES]).abs().max().item(),
        norm=((state[GRAD_NORMS] - want).abs() / want.abs().clamp(min=1)).max().item())


def assert_within(ranks: list[dict], reference: dict, limit: dict, label: str) -> None:
    for rank, state in enumerate(ranks):
        got = deviation(state, reference)
        over = {k: f"{v:.2e} > {limit[k]:.2e}" for k, v in got.items() if not v <= limit[k]}
        assert not over, f"{label}, rank {rank}: {over}"


@functools.cache
def one_process(precision: str, micro_batch_size: int | None = None, inject: bool = False):
    setup = _inject_inf_at_step_2 if inject else None
    return run_ranks(dict(COMMON, precision=precision, micro_batch_size=micro_batch_size), 1,
                     setup=setup, **FNS)[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "pp=2"])
@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_mixed_precision_layout_matches_one_process(precision, layout):
    ranks = run_ranks(dict(COMMON, precision=precision, layout=layout), 2, **FNS)
    fp32 = one_process("fp32")
    # every rank's steps and parameters present, every gradient norm finite (no fp16 step
    # skipped); then each of the three quantities against its own limit
    compare_ranks(fp32, ranks, tol=limits(precision)["norm"], label=f"{precision} {layout}")
    assert_within(ranks, fp32, limits(precision), f"{precision} {layout} vs fp32 one process")
    assert_within(ranks, one_process(precision, micro_batch_size=8), limits(precision, layout),
                  f"{precision} {layout} vs {precision} one process")


@pytest.mark.timeout(200)
def test_fp16_under_pp_without_clipping_or_norms_matches_one_process():
    """Nothing unscales the gradients before the step (no clipping, no gradient norm logged):
    the first stage's scaler, which never scaled a loss, still steps (it failed before)."""
    ranks = run_ranks(dict(COMMON, precision="fp16-mixed", layout="pp=2", log_grad_norm=False),
                      2, **FNS)
    reference = one_process("fp16-mixed", micro_batch_size=8)
    limit = limits("fp16-mixed", "pp=2")
    for rank, state in enumerate(ranks):
        got = deviation({**state, GRAD_NORMS: reference[GRAD_NORMS]}, reference)
        assert got["param"] <= limit["param"] and got["loss"] <= limit["loss"], (rank, got)


# -- overflow ---------------------------------------------------------------------------------
class _InjectInf(Callback):
    """Rank 0 puts an inf into one of its (scaled) gradients after step 2's backward; records
    every step's grad scale and this rank's parameters after steps 1 and 2."""

    def __init__(self):
        self.scales, self.params = [], {}

    def on_fit_start(self, trainer):
        engine, forward_backward = trainer.engine, trainer.engine.forward_backward

        def poisoned(batches):
            out = forward_backward(batches)
            if trainer.rank == 0 and trainer.global_step == 1:  # step 2 is running
                grad = next(p.grad for p in engine.parameters() if p.grad is not None)
                grad = grad.to_local() if hasattr(grad, "to_local") else grad
                grad.view(-1)[0] = math.inf
            return out

        engine.forward_backward = poisoned

    def on_train_step_end(self, trainer, metrics):
        self.scales.append(trainer.precision.scaler.get_scale())
        if trainer.global_step in (1, 2):
            self.params[trainer.global_step] = {
                k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


_RECORDS: list[_InjectInf] = []


def _inject_inf_at_step_2():
    _RECORDS.append(_InjectInf())
    return [_RECORDS[-1]]


def _overflow_rank(kwargs):
    from parity import train_state

    state = train_state(kwargs, setup=_inject_inf_at_step_2, whole_model=False, **FNS)
    record = _RECORDS[-1]
    unchanged = all(torch.equal(v, record.params[2][k]) for k, v in record.params[1].items())
    return state, record.scales, unchanged


@pytest.mark.timeout(200)
def test_fp16_overflow_on_one_pipeline_rank_skips_the_step_on_every_rank():
    from meshtrain.launch.spawn import run_workers

    kwargs = dict(COMMON, precision="fp16-mixed", layout="pp=2")
    results = run_workers(_overflow_rank, 2, (kwargs,), timeout=150)
    init = 2.0 ** 16  # torch.amp.GradScaler's initial scale; it grows only after 2000 steps
    for rank, (_, scales, unchanged) in enumerate(results):
        assert unchanged, f"rank {rank} changed its stage's parameters in the skipped step 2"
        assert scales == [init] + [init / 2] * 7, f"rank {rank}'s grad scale per step: {scales}"
    # the run goes on as one process does when its step 2 overflows (skipped, scale halved)
    reference = one_process("fp16-mixed", micro_batch_size=8, inject=True)
    assert _RECORDS[-1].scales == [init] + [init / 2] * 7
    assert reference[GRAD_NORMS][1].isinf() and reference[GRAD_NORMS].isfinite().sum() == 7
    ranks = [state for state, _, _ in results]
    compare_ranks(reference, ranks, tol=limits("fp16-mixed", "pp=2")["norm"],
                  label="fp16 pp=2 with an overflow at step 2")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,precision", [("zero3=2", "bf16-mixed"),
                                              ("dp_shard=2", "fp16-mixed")])
def test_selective_checkpointing_with_sharded_mixed_precision_recomputes_exactly(layout,
                                                                                precision):
    """FSDP2 casts a block's inputs in its pre-hook, which the recompute runs again: inside the
    selective checkpoint there, so the forward must run it inside too (torch 2.13 failed the
    first backward: an op "encountered during backward but not found in storage"). The
    checkpointed run recomputes the very same operations: equal to the run without."""
    kwargs = dict(COMMON, precision=precision, layout=layout, max_steps=4)
    checkpointed = run_ranks(dict(kwargs, activation_checkpointing="selective"), 2, **FNS)
    plain = run_ranks(kwargs, 2, **FNS)
    for rank, (got, want) in enumerate(zip(checkpointed, plain)):
        assert len(got[LOSSES]) == 4 and torch.equal(got[LOSSES], want[LOSSES]), rank
        assert torch.equal(got[GRAD_NORMS], want[GRAD_NORMS]), rank
        for name, value in params_of(want).items():
            assert torch.equal(got[name], value), (rank, name)
