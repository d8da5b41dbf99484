"""sdc_check_every_n_steps (meshtrain/fault/sdc.py): a flipped bit or a permutation injected into
one rank's gradient (MESHTRAIN_FAULT gradient_allreduce:STEP:RANK:bitflip|permute) is caught at
that step, naming the rank, and handled by nan_policy; a checked run without faults trains bit
for bit as an unchecked one."""

import pytest
import torch
from points_job import train

from meshtrain.checkpoint.safe_load import load_dcp_keys
from meshtrain.errors import ConfigError, WorkerFailed
from meshtrain.fault.inject import corrupt
from meshtrain.fault.sdc import signature
from meshtrain.launch.spawn import run_workers

# dp=2, 2 micro-batches a step (the first is replayed); checked every 2 steps; the GPT with
# dropout (the replay draws the step's masks again, and training goes on with its own)
JOB = ["--layout", "dp=2", "--model", "gpt", "--dropout", "0.1", "--micro-batch-size", "4",
       "--sdc", "2"]


def test_the_checksum_sees_a_flipped_bit_and_a_permutation_that_xor_misses():
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    flipped, permuted = corrupt(grad, "bitflip"), corrupt(grad, "permute")
    assert (flipped != grad).sum() == 1 and torch.allclose(flipped, grad)  # still plausible
    assert sorted(permuted.tolist()) == sorted(grad.tolist())
    assert not torch.equal(signature(flipped), signature(grad))
    assert not torch.equal(signature(permuted), signature(grad))
    assert _xor(permuted) == _xor(grad)  # an XOR of the words (torchtitan's): blind to order
    # bf16 and float64 gradients too (16-bit words, two 32-bit words per element)
    for dtype in (torch.bfloat16, torch.float64):
        g = grad.to(dtype)
        assert not torch.equal(signature(corrupt(g, "bitflip")), signature(g))
        assert not torch.equal(signature(corrupt(g, "permute")), signature(g))


def _xor(tensor: torch.Tensor) -> int:
    out = 0
    for word in tensor.view(torch.int32).tolist():
        out ^= word
    return out


def _final(run_dir):
    return load_dcp_keys(run_dir / "checkpoints" / "final", {"model"})["model"]


@pytest.mark.timeout(240)
def test_a_flipped_bit_and_a_permutation_are_caught_and_a_clean_run_is_unchanged(
        tmp_path, monkeypatch):
    run_workers(train, 2, (["--run-dir", str(tmp_path / "unchecked"), *JOB[:-2]],), timeout=100)
    run_workers(train, 2, (["--run-dir", str(tmp_path / "checked"), *JOB],), timeout=100)
    unchecked, checked = _final(tmp_path / "unchecked"), _final(tmp_path / "checked")
    for name, value in unchecked.items():  # the replay changed nothing (RNG, buffers, grads)
        assert torch.equal(checked[name], value), name

    monkeypatch.setenv("MESHTRAIN_FAULT", "gradient_allreduce:4:1:bitflip")
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, 2, (["--run-dir", str(tmp_path / "flip"), *JOB],), timeout=100)
    text = str(failure.value)
    assert "SilentDataCorruption: step 4 (epoch 0): silent data corruption on rank(s) [1]" in text
    assert "on rank 1 tok_emb.weight's gradient differed first" in text

    monkeypatch.setenv("MESHTRAIN_FAULT", "gradient_allreduce:4:0:permute")
    results = run_workers(train, 2, (["--run-dir", str(tmp_path / "permute"), *JOB,
                                      "--nan-policy", "skip"],), timeout=100)
    assert [r["skipped"] for r in results] == [1, 1]  # the update of step 4, on both ranks


def test_sdc_check_is_refused_before_start_where_it_cannot_replay_exactly():
    from meshtrain import Trainer

    with pytest.raises(ConfigError, match="sdc_check_every_n_steps acts on a mismatch as "
                                          "nan_policy says"):
        Trainer(sdc_check_every_n_steps=2, nan_policy=None)
    for layout, why in (("zero3=2", "FSDP reduce-scatters"), ("ep=2", "ep splits the experts"),
                        ("tp=2", "pp, tp or cp splits")):
        with pytest.raises(ConfigError, match=rf"replays a micro-batch .* but the layout "
                                              rf"\S+ is not \({why}"):
            Trainer(devices=2, layout=layout, sdc_check_every_n_steps=2)
