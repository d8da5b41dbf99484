"""nan_policy: a NaN injected through one sample, on 2 ranks; no checkpoint holds NaN/Inf."""

import pytest
import torch
from fault_job import mlp, train
from records import checkpoints_are_finite, final_weights, assert_equal_weights

from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NAN_INDEX = 37
GLOBAL_BATCH, DP = 16, 2


def where_is(index: int, num_epochs: int = 1) -> list[tuple[int, int]]:
    """[(1-based step, dp rank)] at which the global order gives ``index`` to a rank."""
    found = []
    for dp_rank in range(DP):
        sampler = GlobalBatchSampler(96, global_batch_size=GLOBAL_BATCH,
                                     micro_batch_size=GLOBAL_BATCH // DP, dp_rank=dp_rank,
                                     dp_degree=DP, shuffle=True, seed=0)
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(sampler, start=1 + epoch * len(sampler)):
                if index in batch:
                    found.append((step, dp_rank))
    return sorted(found)


def _job(run_dir, policy, *extra, layout="dp=2"):
    return ["--run-dir", str(run_dir), "--layout", layout, "--max-steps", "10",
            "--nan-index", str(NAN_INDEX), "--nan-policy", policy, *extra]


# dp: gradients are identical after the sync, so each rank decides alone; zero3: each rank
# holds other gradient shards, so the ranks exchange flags every step. "dp=2 deferred": what
# a GPU does under dp (the step's flag read during the next step, or before a checkpoint)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "dp=2 deferred"])
def test_error_names_the_step_and_rank_and_writes_no_bad_checkpoint(tmp_path, layout):
    step, dp_rank = where_is(NAN_INDEX)[0]
    assert 2 < step < 6, "pick NAN_INDEX so that the NaN comes after a checkpoint"
    layout, *deferred = layout.split()
    extra = ["--defer-nan-check"] if deferred else []
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, DP, (_job(tmp_path, "error", "--ckpt-every", "2", *extra,
                                     layout=layout),), timeout=100)
    text = str(failure.value)
    assert "NonFiniteError" in text
    assert f"step {step} (epoch 0): non-finite loss on rank(s) [{dp_rank}]" in text
    saved = checkpoints_are_finite(tmp_path, mlp)
    assert [p.name for p in saved] == [f"step_{s:08d}" for s in range(2, step, 2)]


@pytest.mark.timeout(180)
def test_skip_and_rollback_drop_the_same_update(tmp_path):
    # 6 steps an epoch: the NaN sample comes once in each of the 2 epochs of 10 steps
    num_bad = len([s for s, _ in where_is(NAN_INDEX, num_epochs=2) if s <= 10])
    assert num_bad == 2
    skip = run_workers(train, DP, (_job(tmp_path / "skip", "skip"),), timeout=100)
    rollback = run_workers(
        train, DP, (_job(tmp_path / "rollback", "rollback", "--ckpt-every", "2"),), timeout=100)
    assert [r["skipped"] for r in skip] == [num_bad] * DP  # every rank alike
    assert [(r["skipped"], r["rollbacks"]) for r in rollback] == [(num_bad, num_bad)] * DP
    assert [r["global_step"] for r in skip + rollback] == [10] * 4

    skipped, rolled = final_weights(tmp_path / "skip", mlp), final_weights(tmp_path / "rollback", mlp)
    for value in skipped.values():
        assert torch.isfinite(value).all()
    # rollback = restore the last checkpoint, replay, skip the bad batch: the same as skip
    assert_equal_weights(skipped, rolled)
    checkpoints_are_finite(tmp_path / "rollback", mlp)
    # and the dropped update mattered: a run without the NaN sample ends elsewhere
    run_workers(train, DP, (["--run-dir", str(tmp_path / "clean"), "--layout", "dp=2",
                             "--max-steps", "10"],), timeout=100)
    clean = final_weights(tmp_path / "clean", mlp)
    assert any(not torch.equal(clean[k], skipped[k]) for k in clean)


def test_no_checkpoint_with_non_finite_values_is_written(tmp_path):
    # no policy: the NaN reaches the weights, and every save after it is refused
    step, _ = where_is(NAN_INDEX)[0]
    with pytest.warns(UserWarning, match="NaN/Inf"):
        train(["--run-dir", str(tmp_path), "--max-steps", "8", "--ckpt-every", "1",
               "--nan-index", str(NAN_INDEX), "--nan-policy", "none"])
    saved = checkpoints_are_finite(tmp_path, mlp)
    assert [p.name for p in saved] == [f"step_{s:08d}" for s in range(1, step)]


def _grads_in(storage: torch.Tensor, spans) -> list[torch.nn.Parameter]:
    """Parameters whose gradients are views of ``storage`` at ``spans`` [(offset, shape)], as
    DDP's buckets hold them under gradient_as_bucket_view."""
    params = []
    for offset, shape in spans:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = storage[offset:offset + torch.Size(shape).numel()].view(shape)
        params.append(p)
    return params


def test_the_gradient_check_reads_exactly_the_gradients_and_flags_any_nan_or_inf():
    from meshtrain.fault.nonfinite import FEW_TENSORS, nonfinite_flag

    loss = torch.tensor(1.0)
    spans = [(0, (4, 3)), (12, (5,)), (17, (2, 2))]  # tiling [0, 21) of a bucket of 24
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 13, 20):
            bucket = torch.randn(24)
            bucket[where] = bad
            assert nonfinite_flag(loss, _grads_in(bucket, spans)).item() == 2, (bad, where)
        bucket = torch.randn(24)
        bucket[21:] = bad  # the bucket's tail, past every gradient: not a gradient
        assert nonfinite_flag(loss, _grads_in(bucket, spans)).item() == 0
        bucket = torch.randn(24)
        bucket[12:17] = bad  # a hole between two gradients: each read on its own
        assert nonfinite_flag(loss, _grads_in(bucket, [spans[0], spans[2]])).item() == 0
    # large but finite gradients are not flagged (a norm's squares would overflow float32)
    assert nonfinite_flag(loss, _grads_in(torch.full((24,), 1e30), spans)).item() == 0
    # many separate gradients: one fused pass; and the loss's own bit
    many = [torch.nn.Parameter(torch.zeros(3)) for _ in range(FEW_TENSORS + 5)]
    for p in many:
        p.grad = torch.randn(3)
    assert nonfinite_flag(loss, many).item() == 0
    many[-2].grad[1] = float("nan")
    assert nonfinite_flag(loss, many).item() == 2
    assert nonfinite_flag(loss * float("nan"), many).item() == 3
