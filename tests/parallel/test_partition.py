"""Pipeline partitioning: the min-max split must be exactly optimal (checked against brute force),
its tie-break deterministic, and balance="time" must give measurably balanced stages."""

import itertools
import random
import statistics
import time
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.partition import (
    block_memory_costs, block_param_counts, block_time_costs, min_max_partition,
    partition_blocks, stage_costs,
)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One thread: fast on a shared machine, and block_time_costs then times thread CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Uneven on purpose: by block count two stages get 256 vs 1216 hidden units; the balanced
# split (after block 5) gives 704 vs 768, which evens out the extra per-block overhead of the
# first stage's five blocks against the second's three.
HIDDEN = [64, 64, 64, 64, 448, 256, 256, 256]
D_MODEL, TOKENS = 256, 512


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden)
        self.fc_out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(x)))


def uneven_blocks(hidden=HIDDEN, d_model=D_MODEL) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(MLPBlock(d_model, h) for h in hidden)


def brute_force(costs, num_stages):
    """The documented optimum by enumeration: smallest (stage sums sorted descending, splits)."""
    exact = [Fraction(c) for c in costs]
    best = None
    for splits in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *splits, len(costs)]
        sums = sorted((sum(exact[a:b]) for a, b in zip(bounds, bounds[1:])), reverse=True)
        if best is None or (sums, list(splits)) < best:
            best = (sums, list(splits))
    return best


def max_stage(costs, splits):
    bounds = [0, *splits, len(costs)]
    return max(sum(Fraction(c) for c in costs[a:b]) for a, b in zip(bounds, bounds[1:]))


# ---------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------
def test_matches_brute_force_on_random_costs():
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 10)
        num_stages = rng.randint(1, min(n, 5))
        kind = rng.choice(["int", "float", "mixed"])
        costs = [rng.randint(0, 6) if kind == "int" or (kind == "mixed" and rng.random() < .5)
                 else rng.random() * 10 for _ in range(n)]
        splits = min_max_partition(costs, num_stages)
        best_sums, best_splits = brute_force(costs, num_stages)
        assert max_stage(costs, splits) == best_sums[0], (costs, num_stages)
        assert splits == best_splits, (costs, num_stages)  # the documented tie-break too


@pytest.mark.parametrize("costs, num_stages, expected", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 7]),        # 15 | 13 | 17
    ([10, 1, 1, 1, 1, 10], 3, [1, 5]),                # 10 | 4 | 10
    ([5, 5, 5, 5], 2, [2]),
    ([1, 1, 1, 1, 1, 1, 1, 1, 1], 3, [3, 6]),
    ([0.5, 0.25, 0.25, 1.0], 2, [3]),
    ([7.0, 2.0, 2.0, 3.0], 1, []),                    # K = 1
    ([3, 1, 4, 1, 5], 5, [1, 2, 3, 4]),               # K = n
])
def test_known_answers(costs, num_stages, expected):
    assert min_max_partition(costs, num_stages) == expected


def test_ties_prefer_the_more_even_split_then_the_earlier_splits():
    # Max 6 either way: (6, 3, 2) beats (6, 4, 1) although [1, 2] is lexicographically smaller.
    assert min_max_partition([6, 1, 2, 1, 1], 3) == [1, 3]
    # Every split of four equal blocks into three stages has sums {2, 1, 1}: earliest splits.
    assert min_max_partition([1, 1, 1, 1], 3) == [1, 2]
    assert min_max_partition([0, 0, 0], 3) == [1, 2]
    assert min_max_partition([0.0, 0.0, 0.0, 0.0], 2) == [1]


def test_float_sums_are_compared_exactly():
    # Float prefix sums would lose the 1.0s next to 1e16; exactly, [1, 1 | 1, 1] is most even.
    assert min_max_partition([1e16, 1.0, 1.0, 1.0, 1.0], 3) == [1, 3]
    assert min_max_partition([0.1, 0.2, 0.3], 2) == [2]  # 0.1 + 0.2 > 0.3 in binary
    costs = [0.1] * 10
    assert min_max_partition(costs, 5) == [2, 4, 6, 8]


def test_stage_costs():
    assert stage_costs([1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 7]) == [15.0, 13.0, 17.0]
    assert stage_costs([0.1] * 3, []) == [pytest.approx(0.3)]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_stages", [0, -1, 1.5, True])
def test_bad_num_stages(num_stages):
    with pytest.raises(ConfigError, match="positive integer"):
        min_max_partition([1, 2, 3], num_stages)


def test_more_stages_than_blocks():
    with pytest.raises(ConfigError, match="pp=4 needs at least 4 blocks; the model has 3 — use "
                                          "fewer stages or split blocks"):
        min_max_partition([1, 2, 3], 4)
    with pytest.raises(ConfigError, match="the model has 2"):
        partition_blocks(uneven_blocks([8, 8], d_model=8), 3, balance="params")


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf")])
def test_bad_costs(bad):
    with pytest.raises(ConfigError, match="non-negative"):
        min_max_partition([1, bad, 3], 2)


@pytest.mark.parametrize("splits", [[3, 3], [4, 2], [0, 3], [2, 8], [3], [1, 2, 3], [1.0, 3]])
def test_bad_split_points(splits):
    blocks = uneven_blocks([8] * 8, d_model=8)
    with pytest.raises(ConfigError, match="split_points"):
        partition_blocks(blocks, 3, split_points=splits)
    if len(splits) == 2:
        with pytest.raises(ConfigError, match="split_points"):
            stage_costs([1] * 8, splits)


def test_bad_partition_options():
    blocks = uneven_blocks([8] * 4, d_model=8)
    with pytest.raises(ConfigError, match="unknown balance 'flops'"):
        partition_blocks(blocks, 2, balance="flops")
    for balance in ("time", "memory"):
        with pytest.raises(ConfigError, match="needs sample_input"):
            partition_blocks(blocks, 2, balance=balance)
    with pytest.raises(ConfigError, match="first_extra_cost"):
        partition_blocks(blocks, 2, balance="params", first_extra_cost=-1)
    with pytest.raises(ConfigError, match="repeats"):
        block_time_costs(blocks, torch.randn(2, 8), repeats=0)


# ---------------------------------------------------------------------------------------------
# Balancing real blocks
# ---------------------------------------------------------------------------------------------
def test_manual_split_points_override_and_measure_nothing():
    blocks = uneven_blocks([8] * 6, d_model=8)
    assert partition_blocks(blocks, 3, split_points=[1, 5]) == [1, 5]  # no sample_input needed


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_params_balance_matches_brute_force(num_stages):
    blocks = uneven_blocks()
    counts = block_param_counts(blocks)
    assert counts == [2 * D_MODEL * h + h + D_MODEL for h in HIDDEN]
    splits = partition_blocks(blocks, num_stages, balance="params")
    assert splits == brute_force(counts, num_stages)[1]
    if num_stages == 2:
        assert splits == [5]


def test_extra_costs_go_to_the_first_and_last_stage():
    blocks = uneven_blocks([8] * 4, d_model=8)
    count = block_param_counts(blocks)[0]
    assert partition_blocks(blocks, 2, balance="params") == [2]
    assert partition_blocks(blocks, 2, balance="params", first_extra_cost=2 * count) == [1]
    assert partition_blocks(blocks, 2, balance="params", last_extra_cost=2 * count) == [3]


def test_memory_costs_count_params_and_saved_activations():
    d_model, tokens, hidden = 8, 5, [4, 16, 4]
    blocks = uneven_blocks(hidden, d_model=d_model)
    x = torch.randn(tokens, d_model)
    costs = block_memory_costs(blocks, x)
    # Saved for backward: the block input (fc_in), the GELU input, the GELU output (fc_out).
    expected = [4 * (2 * d_model * h + h + d_model) + 4 * tokens * (d_model + 2 * h)
                for h in hidden]
    assert costs == expected
    assert block_memory_costs(blocks, x, dtype_bytes=2)[0] == expected[0] - 2 * (
        2 * d_model * hidden[0] + hidden[0] + d_model)
    assert partition_blocks(blocks, 2, balance="memory", sample_input=x) == \
        brute_force(costs, 2)[1]


def test_measuring_leaves_grads_and_rng_alone():
    blocks = uneven_blocks([8] * 3, d_model=8)
    blocks.append(nn.Dropout(0.5))
    blocks[0].fc_in.weight.grad = torch.ones_like(blocks[0].fc_in.weight)
    x = torch.randn(4, 8)
    state = torch.get_rng_state()
    block_time_costs(blocks, x, repeats=1, warmup=0)
    block_memory_costs(blocks, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(blocks[0].fc_in.weight.grad, torch.ones(8, 8))
    assert all(p.grad is None for p in blocks[1].parameters())


def test_gpt_layers_with_embedding_and_head():
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16)
    model = GPT(config)
    hidden = model.embed(torch.randint(0, 64, (2, 8))).detach()
    head = sum(p.numel() for p in [*model.norm.parameters(), *model.head.parameters()])
    splits = partition_blocks(model.layers, 2, balance="params", last_extra_cost=head)
    assert splits == min_max_partition([*[block_param_counts(model.layers)[0]] * 3,
                                        block_param_counts(model.layers)[0] + head], 2)
    for balance in ("time", "memory"):
        assert len(partition_blocks(model.layers, 3, balance=balance, sample_input=hidden)) == 2


def stage_times(blocks, x, partitions, *, repeats=11, warmup=1):
    """Median forward+backward CPU seconds of every stage of every partition, each stage's blocks
    run together; rounds interleave all stages so that load from elsewhere hits them alike."""
    inputs = []
    with torch.no_grad():
        for block in blocks:
            inputs.append(x)
            x = block(x)
    stages = [(key, a, b) for key, splits in partitions.items()
              for a, b in zip([0, *splits], [*splits, len(blocks)])]
    samples = {stage: [] for stage in stages}
    for round_ in range(warmup + repeats):
        for stage in stages:
            _, a, b = stage
            start = time.thread_time()  # one torch thread: all of the work runs on this thread
            out = inputs[a].detach().requires_grad_()
            for block in blocks[a:b]:
                out = block(out)
            out.backward(torch.ones_like(out))
            if round_ >= warmup:
                samples[stage].append(time.thread_time() - start)
    blocks.zero_grad(set_to_none=True)
    return {key: [statistics.median(samples[s]) for s in stages if s[0] == key]
            for key in partitions}


def test_time_balance_beats_an_even_split():
    blocks = uneven_blocks()
    x = torch.randn(TOKENS, D_MODEL)
    balanced = partition_blocks(blocks, 2, balance="time", sample_input=x)
    partitions = {"time-balanced": balanced, "even": [len(blocks) // 2]}
    times = stage_times(blocks, x, partitions)
    ratios = {key: max(t) / statistics.mean(t) for key, t in times.items()}
    for key, t in times.items():
        print(f"{key} split {partitions[key]}: stage ms {[round(1e3 * s, 2) for s in t]}, "
              f"max/mean {ratios[key]:.3f}")
    assert balanced == [5]
    assert ratios["time-balanced"] <= 1.15
    assert ratios["time-balanced"] <= ratios["even"]
