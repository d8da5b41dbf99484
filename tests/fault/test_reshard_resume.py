"""Resuming on another layout or world size: same weights, same next loss, same data order."""

import pytest
from fault_job import mlp, tiny_gpt, train
from records import assert_equal_weights, final_weights, steps, weights

from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SAVED_AT = 3


def _run(num_ranks: int, argv: list[str]):
    if num_ranks == 1:
        return train(argv)
    return run_workers(train, num_ranks, (argv,), timeout=150)


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """GPT under zero3 on 2 ranks: SAVED_AT steps then saved, and SAVED_AT + 1 uninterrupted."""
    base = tmp_path_factory.mktemp("zero3")
    common = ["--model", "gpt", "--layout", "zero3=2"]
    _run(2, ["--run-dir", str(base / "saved"), "--max-steps", str(SAVED_AT), *common])
    _run(2, ["--run-dir", str(base / "full"), "--max-steps", str(SAVED_AT + 1), *common])
    return base


# (ranks, layout): one process, tensor parallel on 2, and a 2-D layout on 4
TARGETS = [(1, "dp=1"), (2, "tp=2"), (4, "dp_shard=2,tp=2")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_ranks, layout", TARGETS, ids=[t[1] for t in TARGETS])
def test_zero3_checkpoint_resumes_under_another_layout(zero3_runs, tmp_path, num_ranks, layout):
    saved = zero3_runs / "saved" / "checkpoints" / "final"
    common = ["--model", "gpt", "--layout", layout, "--resume", str(saved)]
    # one more step, saving the weights as loaded first: the same weights, and the loss of the
    # uninterrupted run's step SAVED_AT + 1
    _run(num_ranks, ["--run-dir", str(tmp_path / "next"), "--max-steps", str(SAVED_AT + 1),
                     "--save-loaded", *common])
    assert_equal_weights(weights(tmp_path / "next" / "checkpoints" / "loaded", tiny_gpt),
                         final_weights(zero3_runs / "saved", tiny_gpt))
    resumed, full = steps(tmp_path / "next"), steps(zero3_runs / "full")
    assert list(resumed) == [SAVED_AT + 1]
    assert resumed[SAVED_AT + 1]["samples"] == full[SAVED_AT + 1]["samples"]
    assert abs(resumed[SAVED_AT + 1]["loss"] - full[SAVED_AT + 1]["loss"]) <= 1e-6
    assert_equal_weights(final_weights(tmp_path / "next", tiny_gpt),
                         final_weights(zero3_runs / "full", tiny_gpt), atol=1e-6)


@pytest.mark.timeout(240)
def test_data_order_continues_exactly_on_another_dp_degree(tmp_path):
    # 96 samples, global batch 16: 6 steps an epoch; stop mid-epoch 2 at step 8, finish at 14
    full = ["--max-steps", "14", "--layout", "dp=2"]
    _run(2, ["--run-dir", str(tmp_path / "full"), *full])
    _run(2, ["--run-dir", str(tmp_path / "first"), "--max-steps", "8", "--layout", "dp=2"])
    # resume on one process with micro-batches of 4 (accumulation 4 instead of 1)
    _run(1, ["--run-dir", str(tmp_path / "rest"), "--max-steps", "14", "--layout", "dp=1",
             "--micro-batch-size", "4",
             "--resume", str(tmp_path / "first" / "checkpoints" / "final")])
    uninterrupted = steps(tmp_path / "full")
    resumed = {**steps(tmp_path / "first"), **steps(tmp_path / "rest")}
    assert list(resumed) == list(range(1, 15))
    assert {s: r["samples"] for s, r in resumed.items()} == {
        s: r["samples"] for s, r in uninterrupted.items()}
    for s in range(9, 15):
        assert abs(resumed[s]["loss"] - uninterrupted[s]["loss"]) <= 1e-6, s
    assert_equal_weights(final_weights(tmp_path / "rest", mlp),
                         final_weights(tmp_path / "full", mlp), atol=1e-6)


@pytest.mark.timeout(240)
def test_pipeline_checkpoint_resumes_in_one_process(tmp_path):
    # each pipeline rank saves only its stages, under the full model's names
    common = ["--model", "gpt"]
    _run(2, ["--run-dir", str(tmp_path / "saved"), "--max-steps", str(SAVED_AT),
             "--layout", "pp=2", *common])
    _run(2, ["--run-dir", str(tmp_path / "full"), "--max-steps", str(SAVED_AT + 1),
             "--layout", "pp=2", *common])
    _run(1, ["--run-dir", str(tmp_path / "next"), "--max-steps", str(SAVED_AT + 1),
             "--layout", "dp=1", "--resume", str(tmp_path / "saved" / "checkpoints" / "final"),
             *common])
    resumed, full = steps(tmp_path / "next"), steps(tmp_path / "full")
    assert resumed[SAVED_AT + 1]["samples"] == full[SAVED_AT + 1]["samples"]
    assert abs(resumed[SAVED_AT + 1]["loss"] - full[SAVED_AT + 1]["loss"]) <= 1e-6
    assert_equal_weights(final_weights(tmp_path / "next", tiny_gpt),
                         final_weights(tmp_path / "full", tiny_gpt), atol=1e-6)
