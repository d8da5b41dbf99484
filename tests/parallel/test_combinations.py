"""Layouts that had never been trained before issue 12, against one process. (8-rank mixes, HSDP
with tp or pp, and pp x dp x tp, run in `meshtrain parity`: benchmarks/README.md.)"""

import pytest
from parity import GPT4_FNS, GPT_FNS, assert_parity


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, fns, micro", [
    ("dp_replicate=2,zero2=2", GPT_FNS, None),   # HSDP with ZeRO-2 (no reshard after forward)
    ("zero2=2,tp=2", GPT_FNS, None),
    ("zero2=2,pp=2", GPT4_FNS, 2),
])
def test_never_trained_mixes_match_one_process(layout, fns, micro):
    assert_parity(layout, 4, steps=4, fns=fns, micro_batch_size=micro)
