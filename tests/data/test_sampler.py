"""GlobalBatchSampler: one global order per epoch, independent of the data-parallel degree."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.errors import ConfigError


def make(num_samples, dp_degree=1, dp_rank=0, **kw):
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("micro_batch_size", 2)
    return GlobalBatchSampler(num_samples, dp_rank=dp_rank, dp_degree=dp_degree, **kw)


def all_ranks(num_samples, dp_degree, **kw):
    return [make(num_samples, dp_degree, r, **kw) for r in range(dp_degree)]


def global_batches(samplers):
    """Group the micro-batches of all ranks by global batch (full batches only)."""
    accum = samplers[0].grad_accum_steps
    per_rank = [list(s) for s in samplers]
    num_full = samplers[0].num_samples // samplers[0].global_batch_size
    num_full -= samplers[0].consumed_samples // samplers[0].global_batch_size
    out = []
    for b in range(num_full):
        out.append(
            {i for mbs in per_rank for mb in mbs[b * accum : (b + 1) * accum] for i in mb}
        )
    return out


@pytest.mark.parametrize("num_samples", [23, 37])
@pytest.mark.parametrize("dp_degree", [2, 3])
@pytest.mark.parametrize("global_batch_size,micro_batch_size", [(6, 1), (12, 2), (18, 3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_partial_yields_every_sample_exactly_once(
    num_samples, dp_degree, global_batch_size, micro_batch_size, shuffle
):
    samplers = all_ranks(
        num_samples,
        dp_degree,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        last_batch="partial",
        shuffle=shuffle,
    )
    seen = []
    for s in samplers:
        mbs = list(s)
        assert len(mbs) == len(s)
        assert all(1 <= len(mb) <= micro_batch_size for mb in mbs)
        seen.extend(i for mb in mbs for i in mb)
    assert sorted(seen) == list(range(num_samples))
    assert samplers[0].num_global_batches == -(-num_samples // global_batch_size)


def test_partial_tail_is_split_evenly_and_contiguously():
    # 23 samples, G=12: tail of 11 over 3 ranks -> 4, 4, 3 samples, in order.
    samplers = all_ranks(23, 3, global_batch_size=12, micro_batch_size=2,
                         last_batch="partial", shuffle=False)
    tails = []
    for s in samplers:
        mbs = list(s)
        tails.append([i for mb in mbs[s.grad_accum_steps:] for i in mb])
    assert tails == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22]]
    assert [len(s) for s in samplers] == [2 + 2, 2 + 2, 2 + 2]


def test_partial_rank_with_empty_tail_yields_no_tail_batch():
    # 13 samples, G=12, dp=4: the 1-sample tail goes to rank 0 only.
    samplers = all_ranks(13, 4, global_batch_size=12, micro_batch_size=3, last_batch="partial")
    lengths = [len(list(s)) for s in samplers]
    assert lengths == [2, 1, 1, 1]
    assert [len(s) for s in samplers] == lengths


@pytest.mark.parametrize("dp_degree", [1, 2, 4])
def test_drop_matches_single_rank_global_batches(dp_degree):
    n, g = 37, 8
    reference = [set(b) for b in global_batches([make(n, global_batch_size=g, micro_batch_size=1)])]
    samplers = all_ranks(n, dp_degree, global_batch_size=g, micro_batch_size=2)
    per_rank = [[i for mb in s for i in mb] for s in samplers]
    for a, b in itertools.combinations(per_rank, 2):
        assert not set(a) & set(b)
    assert sum(len(p) for p in per_rank) == (n // g) * g
    assert len(set().union(*map(set, per_rank))) == (n // g) * g
    assert global_batches(samplers) == reference
    assert samplers[0].num_global_batches == n // g
    assert len(samplers[0]) == (n // g) * samplers[0].grad_accum_steps


def test_micro_step_layout_within_global_batch():
    # No shuffle, G=8, M=2, dp=2 -> accum 2; slot k*dp + r.
    r0, r1 = all_ranks(8, 2, global_batch_size=8, micro_batch_size=2, shuffle=False)
    assert list(r0) == [[0, 1], [4, 5]]
    assert list(r1) == [[2, 3], [6, 7]]


def test_reshuffles_per_epoch_and_is_deterministic_per_seed():
    a, b, c = make(40, seed=3), make(40, seed=3), make(40, seed=4)
    epoch0 = list(a)
    assert epoch0 == list(b)
    assert epoch0 != list(c)
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0
    b.set_epoch(1)
    assert list(b) == epoch1
    # The dropped samples differ between epochs (40 % 8 == 0 here, so use 41).
    d = make(41, seed=0)
    dropped = []
    for epoch in range(4):
        d.set_epoch(epoch)
        dropped.append(set(range(41)) - {i for mb in d for i in mb})
    assert all(len(x) == 1 for x in dropped)
    assert len({frozenset(x) for x in dropped}) > 1


def test_iter_does_not_advance_and_advance_moves_position():
    s = make(40)
    assert list(s) == list(s)
    full = list(s)
    s.advance()
    assert s.consumed_samples == 8
    assert list(s) == full[s.grad_accum_steps:]
    assert len(s) == len(full) - s.grad_accum_steps
    s.advance(4)
    assert list(s) == [] and len(s) == 0
    with pytest.raises(ConfigError, match="set_epoch"):
        s.advance()
    s.set_epoch(2)
    assert (s.epoch, s.consumed_samples) == (2, 0)


@pytest.mark.parametrize("new_dp,new_micro", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_resume_on_another_dp_degree_continues_on_same_samples(new_dp, new_micro):
    n, g, k = 100, 16, 3
    uninterrupted = all_ranks(n, 2, global_batch_size=g, micro_batch_size=4, seed=7)
    for s in uninterrupted:
        s.set_epoch(2)
    expected = global_batches(uninterrupted)[k:]

    saved = make(n, 2, 0, global_batch_size=g, micro_batch_size=4, seed=7)
    saved.set_epoch(2)
    saved.advance(k)
    state = saved.state_dict()
    assert state == {"epoch": 2, "consumed_samples": k * g, "seed": 7,
                     "shuffle": True, "num_samples": n}

    resumed = all_ranks(n, new_dp, global_batch_size=g, micro_batch_size=new_micro, seed=7)
    for s in resumed:
        s.load_state_dict(state)
    assert global_batches(resumed) == expected
    assert len(expected) == n // g - k


def test_load_state_dict_rejects_incompatible_state():
    state = make(40, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        make(40, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_samples"):
        make(48, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle"):
        make(40, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ConfigError, match="multiple of global_batch_size=16"):
        make(40, seed=1, global_batch_size=16).load_state_dict({**state, "consumed_samples": 8})
    with pytest.raises(ConfigError, match="missing"):
        make(40, seed=1).load_state_dict({"epoch": 0})


def test_works_as_dataloader_batch_sampler():
    torch.set_num_threads(1)
    data = TensorDataset(torch.arange(30) * 10)
    sampler = make(30, dp_degree=2, dp_rank=1, global_batch_size=8, micro_batch_size=2, seed=5)
    batches = [x for (x,) in DataLoader(data, batch_sampler=sampler)]
    assert len(batches) == len(sampler) == 3 * 2
    expected = [torch.tensor(mb) * 10 for mb in sampler]
    assert all(torch.equal(a, b) for a, b in zip(batches, expected))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(global_batch_size=10, micro_batch_size=2, dp_degree=3), r"10.*3.*2.*multiple of 6"),
        (dict(dp_rank=2, dp_degree=2), "dp_rank=2"),
        (dict(dp_rank=-1), "dp_rank"),
        (dict(micro_batch_size=0), "micro_batch_size must be a positive integer"),
        (dict(global_batch_size=2.0), "global_batch_size"),
        (dict(last_batch="keep"), "'drop'.*'partial'"),
        (dict(global_batch_size=64), r"every epoch would be empty.*partial"),
    ],
)
def test_bad_settings_raise_config_error(kwargs, message):
    args = dict(global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_degree=1)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        GlobalBatchSampler(40, **args)
    with pytest.raises(ConfigError):
        GlobalBatchSampler(0, global_batch_size=8, micro_batch_size=2)


def test_partial_allows_dataset_smaller_than_global_batch():
    samplers = all_ranks(5, 2, global_batch_size=8, micro_batch_size=2, last_batch="partial")
    got = [list(s) for s in samplers]
    assert sorted(i for mbs in got for mb in mbs for i in mb) == list(range(5))
    assert [len(mbs) for mbs in got] == [2, 1]
    samplers[0].advance()
    assert list(samplers[0]) == [] and len(samplers[0]) == 0
