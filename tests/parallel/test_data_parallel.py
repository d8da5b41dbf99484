"""dp=2 must reproduce one-process training on the same global batch."""

import pytest
from parity import assert_parity


@pytest.mark.timeout(180)
def test_dp2_matches_one_process():
    assert_parity("dp=2", 2)


@pytest.mark.timeout(180)
def test_dp2_with_gradient_accumulation_of_4():
    # global 16 = dp 2 x micro 2 x accumulation 4
    assert_parity("dp=2", 2, micro_batch_size=2)


@pytest.mark.timeout(180)
def test_dp2_with_active_clipping():
    # a small max norm so clipping changes every step
    assert_parity("dp=2", 2, micro_batch_size=4, grad_clip_norm=0.05)
