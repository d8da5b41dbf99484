"""Streaming training data (an IterableDataset, meshtrain.data.stream): the same global batches
as a map-style dataset in order, on any dp degree and number of loader workers; a resume on
another world size continues with exactly the next items; bad streams are refused before any
process starts."""

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer, state_of
from parity import adamw, max_param_diff, mlp, regression_data
from torch.utils.data import IterableDataset

from meshtrain.data.sampler import GlobalBatchSampler, eval_loader, train_loaders
from meshtrain.data.stream import StreamSampler
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.usefixtures("one_thread")]


class Numbers(IterableDataset):
    """0, 1, ..., n-1 as one-element tensors; records set_epoch; optional skip and length."""

    def __init__(self, n: int, *, with_len=False):
        self.n, self.with_len, self.epochs = n, with_len, []

    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(self.n))

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        if not self.with_len:
            raise TypeError("a stream without a length")
        return self.n


class Skippable(Numbers):
    def __init__(self, n):
        super().__init__(n)
        self.skipped = []

    def skip(self, count):
        self.skipped.append(count)
        return iter(torch.tensor([i]) for i in range(count, self.n))


class Stream(IterableDataset):
    """A map-style dataset's samples, in index order, as a stream."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


def rank_batches(dataset, *, dp_rank, dp_degree, micro=2, size=8, workers=0, start=0):
    sampler, loader = train_loaders(dataset, dataset, global_batch_size=size,
                                    micro_batch_size=micro, dp_rank=dp_rank, dp_degree=dp_degree,
                                    shuffle=False, seed=0, num_workers=workers, loader_seed=0,
                                    pin_memory=False)
    sampler.consumed_samples = start
    return sampler, [batch.flatten().tolist() for batch in loader]


@pytest.mark.parametrize("dp_degree,workers", [(1, 0), (2, 0), (4, 0), (2, 2)])
def test_a_rank_reads_what_the_global_batch_sampler_gives_it(dp_degree, workers):
    reference = GlobalBatchSampler(37, global_batch_size=8, micro_batch_size=2, dp_degree=dp_degree,
                                   shuffle=False, dp_rank=0)
    for rank in range(dp_degree):
        reference.dp_rank = rank
        _, batches = rank_batches(Numbers(37), dp_rank=rank, dp_degree=dp_degree,
                                  workers=workers)
        assert batches == list(reference), (rank, batches)
    assert len(batches) == 37 // 8 * 8 // (2 * dp_degree)  # the partial global batch is dropped


def test_reading_from_a_position_skips_the_consumed_items():
    _, whole = rank_batches(Numbers(40), dp_rank=1, dp_degree=2)
    _, rest = rank_batches(Numbers(40), dp_rank=1, dp_degree=2, start=16)
    assert rest == whole[4:] and rest[0] == [18, 19]  # slot 1 of global batch 2
    stream = Skippable(40)  # a stream that can skip is asked to
    _, rest = rank_batches(stream, dp_rank=1, dp_degree=2, start=16)
    assert stream.skipped == [16] and rest == whole[4:]


def test_a_pass_ends_with_the_stream_and_each_epoch_is_announced():
    stream = Numbers(20)
    sampler, loader = train_loaders(stream, stream, global_batch_size=8, micro_batch_size=8,
                                    dp_rank=0, dp_degree=1, shuffle=False, seed=0, num_workers=0,
                                    loader_seed=0, pin_memory=False)
    assert sampler.num_global_batches == float("inf")
    batches = iter(loader)
    seen = []
    while not sampler.epoch_done():
        seen.append(next(batches).flatten().tolist())
        sampler.advance()
    assert seen == [list(range(8)), list(range(8, 16))]  # items 16..19 are not a full batch
    sampler.set_epoch(1)
    assert not sampler.epoch_done() and next(iter(loader)).flatten().tolist() == list(range(8))
    assert stream.epochs == [0, 1]


def test_a_stream_too_short_for_one_global_batch_is_a_clear_error():
    sampler, loader = train_loaders(Numbers(5), None, global_batch_size=8, micro_batch_size=8,
                                    dp_rank=0, dp_degree=1, shuffle=False, seed=0,
                                    num_workers=0, loader_seed=0, pin_memory=False)
    iter(loader)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        sampler.epoch_done()


@pytest.mark.parametrize("dp_degree,workers", [(1, 0), (3, 0), (2, 2)])
def test_evaluation_sees_every_item_once_over_the_ranks(dp_degree, workers):
    seen = []
    for rank in range(dp_degree):
        loader = eval_loader(Numbers(23), None, micro_batch_size=4, dp_rank=rank,
                             dp_degree=dp_degree, num_workers=workers, loader_seed=0,
                             pin_memory=False)
        seen += [batch.flatten().tolist() for batch in loader]
    assert sorted(i for batch in seen for i in batch) == list(range(23))
    assert max(len(b) for b in seen) == 4


def test_positions_do_not_cross_between_streams_and_map_style_data():
    stream = StreamSampler(Numbers(40), global_batch_size=8, micro_batch_size=2, dp_rank=0,
                           dp_degree=1)
    indexed = GlobalBatchSampler(40, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match="map-style dataset, and this run streams"):
        stream.load_state_dict(indexed.state_dict())
    with pytest.raises(ConfigError, match="trained on a stream"):
        indexed.load_state_dict(stream.state_dict())
    other = StreamSampler(Numbers(40), global_batch_size=16, micro_batch_size=2, dp_rank=0,
                          dp_degree=1)
    stream.advance()
    with pytest.raises(ConfigError, match="global_batch_size it was trained with \\(8\\)"):
        other.load_state_dict(stream.state_dict())


def test_a_stream_without_a_length_needs_max_steps_before_any_process_starts(tmp_path):
    trainer = quiet_trainer(tmp_path, devices=2, layout="dp=2", max_epochs=1)
    with pytest.raises(ConfigError, match="set max_steps"):
        trainer.fit(mlp, Stream(regression_data()), optimizer=adamw, loss_fn=F.mse_loss)
    assert trainer.mesh is None  # refused before the world started


# ---- training on a stream against one process on the same data, map-style ---------------------
def fit(run_dir, layout, max_steps, stream=True, resume=None, checkpoint_every=None):
    torch.set_num_threads(1)
    data = regression_data()
    trainer = quiet_trainer(run_dir, layout=layout, max_steps=max_steps, shuffle=False,
                            micro_batch_size=4, resume=resume,
                            checkpoint_every_n_steps=checkpoint_every,
                            save_final_checkpoint=checkpoint_every is not None)
    torch.manual_seed(0)
    model = trainer.fit(mlp, Stream(data) if stream else data, val_data=Stream(data),
                        optimizer=adamw, loss_fn=F.mse_loss)
    return state_of(model), trainer.state.sampler.state_dict(), trainer.validate()


@pytest.mark.timeout(240)
def test_dp2_on_a_stream_and_a_resume_on_one_process_match_one_uninterrupted_process(tmp_path):
    reference, _, ref_val = fit(tmp_path / "ref", None, 10, stream=False)
    ranks = run_workers(fit, 2, (tmp_path / "dp", "dp=2", 10), timeout=150)
    for state, position, val in ranks:
        assert max_param_diff(state, reference) <= 1e-5
        # 96 items: 6 global batches of 16 in epoch 0, then 4 of epoch 1
        assert (position["epoch"], position["consumed_samples"], position["kind"]) == (
            1, 64, "stream")
        assert abs(val["val/loss"] - ref_val["val/loss"]) <= 1e-5
    # stop mid-epoch after 4 steps (64 of 96 items) on dp=2; resume on one process to step 10,
    # through the end of the stream into its second pass
    run_workers(fit, 2, (tmp_path / "a", "dp=2", 4, True, None, 4), timeout=150)
    resumed, position, _ = fit(tmp_path / "b", None, 10,
                               resume=str(tmp_path / "a" / "checkpoints" / "final"))
    assert (position["epoch"], position["consumed_samples"]) == (1, 64)
    assert max_param_diff(resumed, reference) <= 1e-5
