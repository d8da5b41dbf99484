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


def _partial_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}  # the MLP's last layer left out


@pytest.mark.timeout(200)
def test_a_user_plan_that_splits_only_some_layers_matches_one_process():
    """The layers a user's plan leaves out are replicated over tp, so clipping and AdamW's
    foreach kernels never meet a plain tensor beside a DTensor (that failed with 'got mixed
    torch.Tensor and DTensor' in the global-norm clipping)."""
    assert_parity("tp=2", 2, steps=6, grad_clip_norm=0.5,
                  parallel_kwargs=dict(tp_plan=_partial_plan()))


def test_a_plan_key_that_names_no_module_is_refused_before_any_process():
    import torch
    from parity import adamw, mlp, regression_data

    from meshtrain import ConfigError, Trainer

    plan = {**_partial_plan(), "4.weight": _partial_plan()["0"]}
    trainer = Trainer(layout="tp=2", devices=2, max_steps=1, tp_plan=plan, progress_bar=False)
    # (raised in fit's checks: under pytest, starting the second process would fail otherwise)
    with pytest.raises(ConfigError, match=r"tp_plan key '4.weight' names no module of "
                                          r"Sequential; did you mean '4'"):
        trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fns", [GPT_FNS, GPT4_FNS], ids=["1-block-stages", "2-block-stages"])
def test_sequence_parallel_on_pipeline_stages_matches_one_process(fns):
    """Each stage slices the sequence at its first block and all-gathers its last block's
    output for the next stage (refused inside fit before, after the processes had started)."""
    assert_parity("pp=2,tp=2", 4, steps=3, fns=fns, micro_batch_size=2,
                  parallel_kwargs=dict(sequence_parallel=True))
