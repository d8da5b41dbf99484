"""A token-mean loss with ignored (padding) targets is layout-invariant (issue 13, item 1).

Samples keep different numbers of targets (the rest are ``-100``), so micro-batches hold
different numbers of tokens. A plain mean loss averages per micro-batch and then averages the
means, which depends on how the global batch is cut (shown first: accumulation alone moves the
parameters by far more than the tolerance). ``meshtrain.losses.cross_entropy`` is a
:class:`~meshtrain.GlobalMeanLoss`: the sum over a micro-batch's tokens divided by the tokens of
the whole step on every rank. Every layout must then equal one process on the global batch
(fp32, AdamW, 10 steps, max |dparam| <= 1e-5, per-step losses and gradient norms).
"""

import pytest
import torch
from parity import (
    adamw_gpt, assert_parity, max_param_diff, padded_tokens, plain_mean_loss, tiny_gpt_seq12,
    train_state,
)

import meshtrain

TOKEN_LOSS = meshtrain.losses.cross_entropy(ignore_index=-100)
FNS = dict(model_fn=tiny_gpt_seq12, data_fn=padded_tokens, loss_fn=TOKEN_LOSS,
           optimizer_fn=adamw_gpt)
COMMON = dict(max_steps=10, global_batch_size=16, log_grad_norm=True)


def test_a_plain_mean_loss_depends_on_how_the_batch_is_cut():
    """What the global-mean loss fixes: with a per-micro-batch mean, accumulation over 4
    micro-batches trains a different model than one micro-batch of 16; the first step warns."""
    fns = dict(FNS, loss_fn=plain_mean_loss)
    whole = train_state(COMMON, **fns)
    warning = r"step.s 4 micro-batches .*=meshtrain\.losses\.cross_entropy\("
    with pytest.warns(UserWarning, match=warning):
        accumulated = train_state(dict(COMMON, micro_batch_size=4), **fns)
    assert max_param_diff(whole, accumulated) > 1e-3


def test_no_warning_without_ignored_targets_or_with_a_global_mean(recwarn):
    from parity import token_data_seq12

    train_state(dict(COMMON, max_steps=1, micro_batch_size=4),
                **dict(FNS, loss_fn=plain_mean_loss, data_fn=token_data_seq12))
    train_state(dict(COMMON, max_steps=1, micro_batch_size=4), **FNS)
    assert not [w for w in recwarn if "ignored tokens" in str(w.message)]


def test_the_global_mean_loss_is_the_token_mean_of_the_whole_batch():
    """One micro-batch: the global-mean loss logs the same loss as the plain token mean."""
    whole = train_state(COMMON, **FNS)
    plain = train_state(COMMON, **dict(FNS, loss_fn=plain_mean_loss))
    assert max_param_diff(whole, plain) < 1e-6


def test_accumulation_matches_one_process():
    assert_parity("dp=1", 1, steps=10, fns=FNS, micro_batch_size=4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout, kwargs", [
    ("dp=2", {}),
    ("dp=2", {"micro_batch_size": 2}),  # and accumulation on each rank
    ("zero3=2", {}),
    ("tp=2", {"parallel_kwargs": {"loss_parallel": True}}),
    ("cp=2", {}),
])
def test_layouts_match_one_process(layout, kwargs):
    assert_parity(layout, 2, steps=10, fns=FNS, **kwargs)


@pytest.mark.timeout(200)
def test_pipeline_with_several_micro_batches_matches_one_process():
    assert_parity("pp=2", 2, steps=10, fns=FNS, micro_batch_size=2)


def _validate(layout: str | None):
    """(val/loss after 3 steps, the token mean over the validation set computed by hand)."""
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = meshtrain.Trainer(layout=layout, max_steps=3, global_batch_size=16,
                                    loggers=(), progress_bar=False, run_dir=run_dir, seed=0,
                                    save_final_checkpoint=False)
        val = padded_tokens(seed=8)
        model = trainer.fit(tiny_gpt_seq12, padded_tokens(), val, optimizer=adamw_gpt,
                            loss_fn=TOKEN_LOSS)
        got = trainer.validate(val)["val/loss"]
        x, y = val.tensors
        with torch.no_grad():
            by_hand = TOKEN_LOSS(model(x), y) / TOKEN_LOSS.count(y)  # model: replicated
        return got, float(by_hand)


@pytest.mark.timeout(200)
def test_validation_is_the_token_mean_of_the_whole_set():
    from meshtrain.launch.spawn import run_workers

    alone, by_hand = _validate(None)
    assert abs(alone - by_hand) < 1e-5
    for got, _ in run_workers(_validate, 2, ("dp=2",), timeout=120):
        assert abs(got - alone) < 1e-5
