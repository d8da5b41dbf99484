"""BatchNorm and in-batch negatives through the Trainer equal one process (issue 13, items 2-3).

BatchNorm: with ``sync_batchnorm`` (the default) the statistics are over every data-parallel
rank's micro-batch, so weights *and* running statistics equal one process on the global batch;
with it off they do not (shown, so the test can fail). Contrastive: a CLIP-style loss whose
negatives come from :func:`meshtrain.gather_batch` equals one process's loss over the whole batch.
"""

import pytest
import torch
from parity import (
    IN_FEATURES, adamw, assert_parity, bn_mlp, max_param_diff, regression_data, run_layout,
    train_state,
)

import meshtrain


BN_FNS = dict(model_fn=bn_mlp, data_fn=regression_data, optimizer_fn=adamw)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2"])
def test_batchnorm_matches_one_process(layout):
    assert_parity(layout, 2, steps=10, fns=BN_FNS)


@pytest.mark.timeout(200)
def test_running_statistics_match_and_per_rank_statistics_do_not():
    common = dict(max_steps=10, global_batch_size=16)
    reference = train_state(common, **BN_FNS)
    synced = run_layout(dict(common, layout="dp=2"), 2, **BN_FNS)
    alone = run_layout(dict(common, layout="dp=2", sync_batchnorm=False), 2, **BN_FNS)
    for name in ("1.running_mean", "1.running_var"):
        assert (synced[name] - reference[name]).abs().max() <= 1e-5
        assert (alone[name] - reference[name]).abs().max() > 1e-3
    assert int(synced["1.num_batches_tracked"]) == int(reference["1.num_batches_tracked"]) == 10
    assert max_param_diff(alone, reference) > 1e-3


@pytest.mark.timeout(200)
def test_batchnorm_with_accumulation_matches_one_process_with_the_global_micro_batch():
    """Per micro-batch statistics by nature: dp=2 with micro-batches of 4 is one process with
    micro-batches of 8 (the two ranks' micro-batches together)."""
    common = dict(max_steps=6, global_batch_size=16)
    reference = train_state(dict(common, micro_batch_size=8), **BN_FNS)
    layout = run_layout(dict(common, layout="dp=2", micro_batch_size=4), 2, **BN_FNS)
    assert max_param_diff(layout, reference) <= 1e-5


# -- in-batch negatives ----------------------------------------------------------------------
class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query = torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 8))
        self.key = torch.nn.Linear(3, 8)

    def forward(self, pair):
        x, y = pair
        return (torch.nn.functional.normalize(self.query(x), dim=-1),
                torch.nn.functional.normalize(self.key(y), dim=-1))


def paired_data():
    """Each sample's query input and its positive key input: ((x, y), unused target)."""
    x, y = regression_data().tensors
    return torch.utils.data.StackDataset(torch.utils.data.StackDataset(x, y),
                                         torch.zeros(len(x)))


def clip_loss(embeddings, _targets):
    queries, keys = embeddings
    all_keys, mine = meshtrain.gather_batch(keys)
    logits = queries @ all_keys.T / 0.1
    labels = torch.arange(all_keys.shape[0], device=logits.device)[mine]
    return torch.nn.functional.cross_entropy(logits, labels)


def local_clip_loss(embeddings, _targets):
    """The same loss with each rank's own negatives only."""
    queries, keys = embeddings
    logits = queries @ keys.T / 0.1
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(keys)))


CLIP_FNS = dict(model_fn=TwoTower, data_fn=paired_data, optimizer_fn=adamw, loss_fn=clip_loss)


@pytest.mark.timeout(200)
def test_contrastive_loss_with_gathered_negatives_matches_one_process():
    assert_parity("dp=2", 2, steps=10, fns=CLIP_FNS)


@pytest.mark.timeout(200)
def test_contrastive_loss_with_local_negatives_does_not():
    common = dict(max_steps=10, global_batch_size=16)
    reference = train_state(common, **dict(CLIP_FNS, loss_fn=local_clip_loss))
    layout = run_layout(dict(common, layout="dp=2"), 2, **dict(CLIP_FNS, loss_fn=local_clip_loss))
    assert max_param_diff(layout, reference) > 1e-3
