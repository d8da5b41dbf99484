"""ZeRO-1/2/3 and HSDP through the Trainer reproduce one-process training on the same batch."""

import pytest
from parity import GPT_FNS, assert_parity


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["zero1=2", "zero2=2", "zero3=2"])
def test_zero_stages_match_one_process(layout):
    assert_parity(layout, 2)


@pytest.mark.timeout(240)
def test_hsdp_2x2_matches_one_process():
    assert_parity("dp_replicate=2,dp_shard=2", 4, micro_batch_size=4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["zero2=2", "zero3=2"])
def test_zero_with_gradient_accumulation_and_clipping(layout):
    # global 16 = 2 shards x micro 2 x accumulation 4; a small max norm clips every step
    # (zero2 keeps its parameters gathered between the micro-batches of a step)
    assert_parity(layout, 2, micro_batch_size=2, grad_clip_norm=0.05)


@pytest.mark.timeout(180)
def test_zero3_gpt_built_on_the_meta_device_matches_one_process():
    # the GPT factory has init_weights(), so each rank builds it on meta and fills its shards
    assert_parity("zero3=2", 2, steps=10, fns=GPT_FNS)


@pytest.mark.timeout(180)
def test_zero3_bf16_mixed_within_a_looser_tolerance():
    # bf16 compute (fp32 master weights and reductions) against an fp32 one-process run: the
    # difference is bf16 rounding amplified by Adam, not a sharding error (measured ~2e-2 for
    # dp=2 too), so the bound is looser than fp32's 1e-5.
    assert_parity("zero3=2", 2, tol=5e-2, precision="bf16-mixed",
                  reference_kwargs={"precision": "fp32"})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_zero3_with_activation_checkpointing_matches_one_process(mode):
    # recomputing activations in backward must not change a single gradient
    assert_parity("zero3=2", 2, steps=6, fns=GPT_FNS, activation_checkpointing=mode,
                  reference_kwargs={"activation_checkpointing": None})
