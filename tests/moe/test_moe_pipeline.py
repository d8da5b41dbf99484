"""meshtrain's MoE GPT under pipeline parallel (meshtrain/moe/pipeline.py): the balancing loss
added inside the stages, over each pipeline micro-batch's tokens of every data-parallel rank,
equals one process accumulating micro-steps of the same samples (float64, tests/parity.py)."""

import pytest
import torch
from parity import assert_parity
from test_moe_gpt import MOE_FNS, moe_gpt, moe_gpt_bias_balanced

torch.set_num_threads(1)


def moe_gpt_4_layers():
    return moe_gpt(num_layers=4)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout, devices, model_fn, options", [
    # experts split over the 2 ranks of each stage; the balancing loss and bias together
    ("pp=2,ep=2", 4, moe_gpt_bias_balanced, {}),
    # the zero-bubble schedule splits the backward
    ("pp=2", 2, moe_gpt_4_layers, dict(parallel_kwargs=dict(pp_schedule="zero-bubble"))),
    # recomputed forwards (inside the backward) add nothing twice
    ("pp=2", 2, moe_gpt, dict(activation_checkpointing="full")),
    # the same with compiled blocks (the balancing hook runs outside the graphs: layer.py)
    ("pp=2", 2, moe_gpt, dict(activation_checkpointing="full",
                              parallel_kwargs=dict(compile=True))),
    # two stages a rank, interleaved
    ("pp=2", 2, moe_gpt_4_layers, dict(parallel_kwargs=dict(pp_schedule="interleaved-1f1b",
                                                            stages_per_rank=2))),
    # every expert split by hidden unit in each stage (moe/tensor_parallel.py)
    ("pp=2,tp=2", 4, moe_gpt_bias_balanced, dict(parallel_kwargs=dict(sequence_parallel=True))),
    # each stage's sequence split over cp, whose ranks ep borrows for the experts
    ("pp=2,cp=2,ep=2", 4, moe_gpt_bias_balanced, {}),
], ids=["pp=2,ep=2", "pp=2 zero-bubble", "pp=2 checkpointing", "pp=2 compiled checkpointing",
        "pp=2 interleaved", "pp=2,tp=2", "pp=2,cp=2,ep=2"])
def test_moe_gpt_under_pipelines_matches_one_process(layout, devices, model_fn, options):
    """Pipeline micro-batch i of every data-parallel rank is one process's accumulation
    micro-step i (the loader lays the samples out so): 4 samples a micro-batch each side."""
    data = 2 if "ep" in layout and "cp" not in layout else 1  # data-parallel ranks a stage
    assert_parity(layout, devices, steps=4, global_batch_size=16,
                  fns=dict(MOE_FNS, model_fn=model_fn), micro_batch_size=4,
                  reference_kwargs=dict(micro_batch_size=4 * data), **options)


def test_a_pipelines_draws_are_the_micro_steps_accumulation_reads():
    """Under pp each draw is a rank's whole step; with ``piece_size`` its pieces are the
    samples the rank would read as accumulation micro-batches (rank r's piece i = global
    micro-step i's r-th part), for map-style data and streams alike."""
    from meshtrain.data.sampler import GlobalBatchSampler
    from meshtrain.data.stream import _RankSlices

    order = list(range(16))
    pieces = {}
    for rank in (0, 1):
        sampler = GlobalBatchSampler(16, global_batch_size=16, micro_batch_size=8,
                                     dp_rank=rank, dp_degree=2, shuffle=False, piece_size=4)
        (draw,) = list(sampler)
        pieces[rank] = [draw[:4], draw[4:]]
        stream = _RankSlices(order, epoch=0, start=0, global_batch_size=16, micro_batch_size=8,
                             dp_rank=rank, dp_degree=2, piece_size=4)
        assert list(stream) == draw
    accumulated = [GlobalBatchSampler(16, global_batch_size=16, micro_batch_size=4, dp_rank=r,
                                      dp_degree=2, shuffle=False) for r in (0, 1)]
    by_rank = [list(s) for s in accumulated]
    for i in (0, 1):  # micro-step i: both ranks' i-th micro-batch
        assert sorted(pieces[0][i] + pieces[1][i]) == sorted(by_rank[0][i] + by_rank[1][i])
    assert pieces[0][0] == [0, 1, 2, 3] and pieces[1][0] == [4, 5, 6, 7]
