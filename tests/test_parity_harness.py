"""The parity harness must fail when a layout trains differently from one process.

Each test injects one bug of a kind that frameworks have shipped into the layout's run only
(through ``assert_parity(setup=...)``, which runs on every rank before training) and expects
``assert_parity`` to raise, naming what it saw. The same calls without the fault pass elsewhere
in the suite (tests/parallel/*), so the failure is the fault's doing.
"""

import pytest
import torch
import torch.distributed as dist
from parity import (
    GPT4_FNS, assert_parity, compare_ranks, max_param_diff, run_ranks, sgd, train_state,
)

from meshtrain import Callback


class _ScaleGradients(Callback):
    """Gradients off by a constant factor: a missing (or doubled) division by the number of
    micro-batches or ranks."""

    def __init__(self, factor):
        self.factor = factor

    def on_before_optimizer_step(self, trainer):
        for param in trainer.model.parameters():
            if param.grad is not None:
                param.grad.mul_(self.factor)


def double_gradients():
    return [_ScaleGradients(2.0)]


@pytest.mark.timeout(120)
def test_gradients_doubled_under_adamw_are_caught_by_the_gradient_norm():
    # AdamW hides a constant factor in the parameters (2x moves them by ~1.5e-5 here); the
    # gradient norm before clipping shows it at the first step
    with pytest.raises(AssertionError, match=r"gradient norm at step 1 .* \(ratio 2\b"):
        assert_parity("dp=2", 2, steps=10, setup=double_gradients)


@pytest.mark.timeout(120)
def test_gradients_doubled_under_active_clipping_are_caught():
    # clipping on every step removes the factor from the update entirely (8.9e-8 apart)
    with pytest.raises(AssertionError, match=r"gradient norm at step 1 .* \(ratio 2\b"):
        assert_parity("dp=2", 2, steps=10, micro_batch_size=4, grad_clip_norm=0.05,
                      setup=double_gradients)


def scale_gradients_by_a_millionth():
    return [_ScaleGradients(1 + 1e-6)]


@pytest.mark.timeout(150)
def test_in_float64_a_gradient_off_by_a_millionth_fails_where_fp32_cannot_tell():
    # fp32 rounding is ~1e-7 per operation, so the fp32 comparison (tolerance 1e-5) passes a
    # gradient scaled by 1 + 1e-6; in float64 an exact layout agrees to ~1e-14 and it parts
    assert_parity("dp=2", 2, steps=6, setup=scale_gradients_by_a_millionth, float64=False)
    with pytest.raises(AssertionError, match=r"in float64.*: rank 0's gradient norm at step 1 .*"
                                             r"relative difference 1\.0e-06"):
        assert_parity("dp=2", 2, steps=6, setup=scale_gradients_by_a_millionth)


def clip_each_stage_by_its_own_norm():
    """The pipeline's clipping without the sum over stages: each rank's local norm."""
    import meshtrain.parallel.pipeline as pipeline

    def local_clip(parameters, max_norm, pp_group, copies=frozenset()):
        params = [p for p in parameters if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    pipeline.clip_grad_norm_ = local_clip


@pytest.mark.timeout(150)
def test_a_stage_clipped_by_its_own_norm_is_caught_in_the_parameters_under_sgd():
    # each stage's norm is its own from step 1 on, and the parameters follow
    with pytest.raises(AssertionError, match=r"rank \d's gradient norm at step 1 "):
        assert_parity("pp=2", 2, steps=6, grad_clip_norm=0.05, setup=clip_each_stage_by_its_own_norm,
                      fns=dict(GPT4_FNS, optimizer_fn=sgd))


class _SkipAllReduceOnRank1(Callback):
    """At the last step, rank 1 takes part in DDP's all-reduce (so no rank hangs) but keeps its
    own gradients: rank 0 ends exactly like one process, rank 1 does not."""

    def on_fit_start(self, trainer):
        if dist.get_rank() != 1:
            return

        def keep_local_at_the_last_step(state, bucket):
            local = bucket.buffer()
            averaged = local / dist.get_world_size()
            future = dist.all_reduce(averaged, async_op=True).get_future()
            last = trainer.global_step == trainer.max_steps - 1
            return future.then(lambda _: local if last else averaged)

        trainer.engine.train_module.register_comm_hook(None, keep_local_at_the_last_step)


def skip_all_reduce_on_rank_1():
    return [_SkipAllReduceOnRank1()]


@pytest.mark.timeout(120)
def test_a_replica_that_skips_its_all_reduce_is_caught_on_that_rank():
    common = dict(max_steps=10, global_batch_size=16, log_grad_norm=True)
    reference = train_state(common)
    ranks = run_ranks(dict(common, layout="dp=2"), 2, setup=skip_all_reduce_on_rank_1)
    # rank 0's parameters, norms and losses still equal one process: the harness that
    # compared rank 0's parameters alone passed this
    compare_ranks(reference, ranks[:1], label="dp=2")
    assert max_param_diff(reference, ranks[1]) > 1e-3
    with pytest.raises(AssertionError, match=r"rank 1's gradient norm at step 10 "):
        compare_ranks(reference, ranks, label="dp=2")


@pytest.mark.timeout(150)
def test_the_same_pipeline_run_without_the_fault_passes():
    # the control for the clipping test above: SGD, clipping active, pp=2
    assert_parity("pp=2", 2, steps=6, grad_clip_norm=0.05, fns=dict(GPT4_FNS, optimizer_fn=sgd))
