"""Tensor-parallel layouts through the Trainer reproduce one-process training (a tiny GPT)."""

import pytest
from parity import GPT4_FNS, GPT_FNS, assert_parity


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options", [
    {}, dict(sequence_parallel=True), dict(loss_parallel=True),
])
def test_tp2_matches_one_process(options):
    assert_parity("tp=2", 2, steps=10, fns=GPT_FNS, parallel_kwargs=options)


@pytest.mark.timeout(200)
def test_tp2_with_clipping():
    assert_parity("tp=2", 2, steps=10, fns=GPT_FNS, grad_clip_norm=0.05)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp=2,tp=2", "dp_shard=2,tp=2", "pp=2,tp=2"])
def test_tp2_composed_with_dp_or_pp_matches_one_process(layout):
    fns = GPT4_FNS if "pp" in layout else GPT_FNS
    assert_parity(layout, 4, steps=5, fns=fns, micro_batch_size=2 if "pp" in layout else None)


@pytest.mark.timeout(300)
def test_3d_pp2_dp_shard2_tp2_on_8_ranks_matches_one_process():
    # data x pipeline x tensor parallel on one 2x2x2 mesh (8 processes on 2 cores: 3 steps)
    assert_parity("pp=2,dp_shard=2,tp=2", 8, steps=3, fns=GPT4_FNS, micro_batch_size=4)
