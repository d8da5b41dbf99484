"""Pipeline partitioning: the min-max split must be exactly optimal (checked against brute force),
its tie-break deterministic, and balance="time" must split by the forward+backward time measured
per block (checked with blocks that charge known seconds to a fake clock, not by timing)."""

import itertools
import math
import random
import time
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.pipeline import partition
from meshtrain.parallel.pipeline.partition import (
    block_memory_costs, block_param_counts, block_time_costs, min_max_partition,
    partition_blocks, stage_costs,
)


# one torch thread: fast on a shared machine, and block_time_costs then times thread CPU time
pytestmark = pytest.mark.usefixtures("one_thread")


# Uneven on purpose: by block count two stages get 256 vs 1216 hidden units; by parameters the
# balanced split is after block 5 (704 vs 768 hidden units).
HIDDEN = [64, 64, 64, 64, 448, 256, 256, 256]
D_MODEL = 256


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
    costs = block_time_costs(blocks, x, repeats=1, warmup=0)  # measured: only its form is known
    assert len(costs) == len(blocks) and all(math.isfinite(c) and c >= 0 for c in costs), costs
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


# ---------------------------------------------------------------------------------------------
# balance="time" with injected costs: blocks that charge known seconds to a fake clock
# ---------------------------------------------------------------------------------------------
class FakeClock:
    """Seconds that pass only when a CostBlock charges them, so every measured time is known."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ChargeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.block.clock.now += ctx.block.backward_cost
        return grad, None


class CostBlock(nn.Module):
    """Its forward and its backward each advance ``clock`` by a fixed cost; ``extra`` adds
    seconds to given calls with grad on (counted from 0), like a one-off warm-up cost or a burst
    of load from elsewhere. One parameter each: by parameter count all blocks are equal."""

    def __init__(self, clock: FakeClock, forward_cost: float, backward_cost: float,
                 extra: dict[int, float] | None = None) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.clock, self.forward_cost, self.backward_cost = clock, forward_cost, backward_cost
        self.extra, self.calls = dict(extra or {}), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.clock.now += self.extra.get(self.calls, 0.0)
            self.calls += 1
        self.clock.now += self.forward_cost
        return _ChargeBackward.apply(x * self.scale, self)


def test_time_costs_are_the_median_forward_plus_backward_after_warmup():
    def blocks(clock):
        return nn.ModuleList([
            CostBlock(clock, 1.0, 2.0, extra={0: 100.0}),  # slow first call: the warm-up round
            CostBlock(clock, 4.0, 8.0, extra={2: 50.0}),   # a burst in the 2nd timed round
            CostBlock(clock, 0.5, 0.25),
        ])

    clock, x = FakeClock(), torch.randn(3, 4)
    assert block_time_costs(blocks(clock), x, repeats=3, warmup=1, clock=clock) == \
        [3.0, 12.0, 0.75]
    # the warm-up round is not counted; without one, the first call's cost is what is measured
    assert block_time_costs(blocks(clock), x, repeats=1, warmup=1, clock=clock) == \
        [3.0, 12.0, 0.75]
    assert block_time_costs(blocks(clock), x, repeats=1, warmup=0, clock=clock) == \
        [103.0, 12.0, 0.75]


def test_time_costs_default_clock():
    cpu = torch.device("cpu")
    assert partition._clock_for(cpu) is time.thread_time  # one torch thread (fixture): CPU time
    torch.set_num_threads(2)  # the fixture restores it
    assert partition._clock_for(cpu) is time.perf_counter


def test_time_balance_splits_by_the_measured_costs(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(partition, "_clock_for", lambda device: clock)
    forward = [1.0, 1.0, 1.0, 1.0, 4.0, 3.0, 3.0, 3.0]
    blocks = nn.ModuleList(CostBlock(clock, f, 2 * f) for f in forward)  # backward = 2 forward
    costs = [3 * f for f in forward]
    x = torch.randn(2, 4)
    assert block_time_costs(blocks, x) == costs
    assert partition_blocks(blocks, 2, balance="params") == [4]  # equal counts: 4 | 4 blocks
    assert partition_blocks(blocks, 2, balance="time", sample_input=x) == [5]  # 24 | 27 s
    for num_stages in (2, 3, 4):
        assert partition_blocks(blocks, num_stages, balance="time", sample_input=x) == \
            brute_force(costs, num_stages)[1]
    # the head's seconds go to the last block: 42 | 39 s
    assert partition_blocks(blocks, 2, balance="time", sample_input=x, last_extra_cost=30.0) == \
        [7] == brute_force([*costs[:-1], costs[-1] + 30.0], 2)[1]
