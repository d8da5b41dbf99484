"""Trainer options that README.md promises, against one-process training: DDP bucket size and
PowerSGD rank, pipeline partitioning by measured time and memory, and the pipeline schedules that
tests/parallel/test_pipeline_parity.py does not run (looped-bfs, zbv, dualpipev)."""

import re

import pytest
import torch
import torch.nn as nn
from parity import (
    GPT4_FNS, LOSSES, VOCAB, adamw_gpt, assert_parity, lm_loss, max_param_diff, run_layout,
    token_data, train_state,
)

from meshtrain.launch.spawn import run_workers


# ---- DDP: bucket size -------------------------------------------------------------------------
def _sgd_momentum(params):
    # SGD shows communication error as it is (Adam rescales a near-zero gradient to a full step)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _recording_ddp():
    """Make apply_ddp keep every DDP wrapper it builds (in a worker process only)."""
    import meshtrain.parallel.data.data_parallel as data_parallel

    built, original = [], data_parallel.apply_ddp

    def apply_ddp(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    data_parallel.apply_ddp = apply_ddp  # apply.py imports it at call time
    return built


def _bucket_rank(kwargs):
    built = _recording_ddp()
    state = train_state(kwargs)
    (ddp,) = built
    info = ddp._get_ddp_logging_data()
    return state, {"cap_bytes": info["bucket_cap_bytes"], "rebuilt": info["has_rebuilt_buckets"],
                   "num_buckets": len(ddp.reducer._get_zeros_like_grad_buckets())}


@pytest.mark.timeout(120)
def test_tiny_bucket_cap_gives_several_buckets_and_matches_one_process():
    # 1e-4 MB = 104 bytes: the MLP's 6 gradients (6.3 kB) fall into 5 buckets instead of 1
    common = dict(max_steps=8, global_batch_size=16, micro_batch_size=4)  # accumulation 2
    reference = run_layout(dict(common), 1)
    state, buckets = run_workers(
        _bucket_rank, 2, (dict(common, layout="dp=2", bucket_cap_mb=1e-4),), timeout=100)[0]
    assert buckets == {"cap_bytes": 104, "rebuilt": 1, "num_buckets": 5}
    diff = max_param_diff(reference, state)
    assert diff <= 1e-5, f"bucket_cap_mb=1e-4 differs from one process by {diff:.3e}"
    assert max_param_diff(reference, run_layout(dict(common, max_steps=1), 1)) > 1e-3
    assert (reference[LOSSES] - state[LOSSES]).abs().max().item() <= 1e-5


# ---- DDP: PowerSGD rank -----------------------------------------------------------------------
POWERSGD_COMMON = dict(max_steps=15, global_batch_size=16)


def _powersgd_rank(ranks):
    return {r: train_state(dict(POWERSGD_COMMON, layout="dp=2", comm_hook="powersgd",
                                powersgd_rank=r), optimizer_fn=_sgd_momentum) for r in ranks}


@pytest.mark.timeout(150)
def test_powersgd_rank_changes_the_result_and_a_rank_too_large_to_compress_is_exact():
    reference = run_layout(dict(POWERSGD_COMMON), 1, optimizer_fn=_sgd_momentum)
    # one job, a fresh Trainer per rank: cheaper than starting processes per rank
    results = run_workers(_powersgd_rank, 2, ((1, 2, 8),), timeout=140)[0]
    diff = {r: max_param_diff(reference, state) for r, state in results.items()}
    # torch's PowerSGD hook all-reduces a matrix as it is when rank (rows + cols) * 2 >= rows * cols
    # (compression would not halve it); the MLP's largest such rank is 7 (its 32x32 weight), so
    # at rank 8 nothing is compressed and dp=2 equals one process
    assert diff[8] <= 1e-5, f"powersgd_rank=8 differs from one process by {diff[8]:.3e}"
    # ranks 1 and 2 compress (lossy): both differ from exact training, and from each other
    assert diff[1] > 1e-3 and diff[2] > 1e-3, diff
    rank_gap = max_param_diff(results[1], results[2])
    assert rank_gap > 1e-3, f"powersgd_rank=2 trained like rank 1 (gap {rank_gap:.2e})"
    # (deterministic here: PowerSGD seeds its own generator; measured 2.6e-2 vs 5.6e-2)
    assert diff[2] < diff[1], f"rank 2 should approximate better than rank 1: {diff}"
    for r, state in results.items():  # and both still train
        losses = state[LOSSES]
        assert len(losses) == POWERSGD_COMMON["max_steps"]
        assert losses[-3:].mean() < 0.7 * losses[:3].mean(), f"powersgd_rank={r}: {losses}"


# ---- pipeline: partitioning by measured time and memory ---------------------------------------
D_MODEL = 16


class UnequalBlock(nn.Module):
    """x + fc_out(tanh(fc_in(x))) with ``hidden`` units, plus optional parameter-free extras:
    ``fan_out`` copies of x through tanh (activations saved for backward: memory), and ``busy``
    256x256 matmuls under no_grad whose result is unused (time, but no memory and no effect on
    the output)."""

    def __init__(self, hidden: int = 8, fan_out: int = 0, busy: int = 0):
        super().__init__()
        self.fc_in = nn.Linear(D_MODEL, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, D_MODEL, bias=False)
        self.fan_out, self.busy = fan_out, busy

    def forward(self, x):
        out = x + self.fc_out(torch.tanh(self.fc_in(x)))
        if self.fan_out:
            wide = torch.tanh(x.repeat(1, 1, self.fan_out))
            out = out + 0.5 * wide.unflatten(-1, (self.fan_out, D_MODEL)).mean(-2)
        if self.busy:
            with torch.no_grad():
                work = torch.ones(256, 256)  # on the CPU, also for a model on a GPU
                for _ in range(self.busy):
                    work = torch.tanh(work @ work)
        return out


class UnequalModel(nn.Module):
    """Four blocks whose costs put the 2-stage split in a different place for each balance:

    =====  ======  ========================================  ==========  ===================
    block  params  memory (bytes: 4/param + saved, batch 8)  time (CPU)  role
    =====  ======  ========================================  ==========  ===================
    0      8192    102 k                                     ~0.5 ms     most parameters
    1      256     138 k                                     ~0.8 ms     some activations
    2      256     531 k                                     ~1.2 ms     most activations
    3      256     7 k                                       ~25 ms      most time
    =====  ======  ========================================  ==========  ===================

    params: [1] (8192 | 768; [2] and [3] have a stage of 8448+). memory (exact, no noise): [2]
    (240 k | 539 k; [1] and [3] have a stage of 677 k / 772 k). time: [3] (block 3 alone is
    ~9x blocks 0-2 together, so the split holds on a loaded machine and on every rank).
    """

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList([
            UnequalBlock(hidden=256), UnequalBlock(fan_out=32), UnequalBlock(fan_out=128),
            UnequalBlock(busy=80),
        ])
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def embed(self, idx):
        return self.tok_emb(idx)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


UNEQUAL_FNS = dict(model_fn=UnequalModel, data_fn=token_data, loss_fn=lm_loss,
                   optimizer_fn=adamw_gpt)


def test_the_unequal_model_costs_give_three_different_splits():
    """The premise of the Trainer tests below, checked on the costs themselves (one process)."""
    from meshtrain.parallel.pipeline.partition import partition_blocks

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = UnequalModel()
    sample = model.embed(token_data().tensors[0][:8]).detach()  # the Trainer's micro-batch of 8
    blocks = list(model.layers)
    assert [partition_blocks(blocks, 2, balance=b, sample_input=sample)
            for b in ("params", "memory", "time")] == [[1], [2], [3]]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("balance, split", [("time", [3]), ("memory", [2])])
def test_pp_balance_picks_the_measured_split_and_matches_one_process(capfd, balance, split):
    # (params would split at [1]: a Trainer that ignored pp_balance fails here)
    assert_parity("pp=2", 2, steps=8, fns=UNEQUAL_FNS, parallel_kwargs=dict(pp_balance=balance))
    printed = capfd.readouterr().out  # rank 0's line, written by the worker process
    line = re.search(r"pipeline: 2 stages split before blocks (\[[\d, ]*\]) \((\w+)-balanced\)",
                     printed)
    assert line is not None, printed
    assert (line.group(1), line.group(2)) == (str(split), balance)


# ---- pipeline schedules -----------------------------------------------------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize("pipeline", [
    dict(pp_schedule="looped-bfs", stages_per_rank=2),
    dict(pp_schedule="zbv", stages_per_rank=2),
    dict(pp_schedule="dualpipev", stages_per_rank=2),
], ids=lambda p: p["pp_schedule"])
def test_pp2_multi_stage_schedules_match_one_process(pipeline):
    # 4 blocks, 4 stages (2 per rank); global batch 16 -> 4 micro-batches of 4 (dualpipev: >= 4)
    assert_parity("pp=2", 2, steps=10, fns=GPT4_FNS, parallel_kwargs=pipeline)


@pytest.mark.timeout(200)
def test_zero_bubble_schedules_with_zero2_match_one_process():
    """zbv with zero2 (parameters kept gathered to backward) trains like one process; with zero3
    the weight-gradient pass runs on resharded blocks (0.76x the gradient norm): refused."""
    assert_parity("pp=2,zero2=2", 4, steps=4, fns=GPT4_FNS, micro_batch_size=2,
                  parallel_kwargs=dict(pp_schedule="zbv", stages_per_rank=2))


def test_zero_bubble_schedules_with_zero3_are_refused_before_start(monkeypatch):
    from parity import adamw_gpt, tiny_gpt_4_layers, token_data

    from meshtrain import ConfigError, Trainer

    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="4").items():  # rank 0 as a launcher starts it
        monkeypatch.setenv(name, value)
    trainer = Trainer(layout="pp=2,zero3=2", max_steps=1, pp_schedule="zbv", stages_per_rank=2,
                      global_batch_size=16, progress_bar=False)
    with pytest.raises(ConfigError, match="zero3/dp_shard gives wrong gradients .* zero2"):
        trainer.fit(tiny_gpt_4_layers, token_data(), optimizer=adamw_gpt,
                    loss_fn=lambda out, y: out.sum())


def test_split_backward_schedules_with_activation_checkpointing_are_refused_before_start(
        monkeypatch):
    """zero-bubble, zbv and dualpipev run the weight backward apart, which re-enters the
    checkpoint's recomputation and fails inside the first step in torch 2.13 (dense models
    too): refused before start."""
    from parity import adamw_gpt, tiny_gpt_4_layers, token_data

    from meshtrain import ConfigError, Trainer

    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="2").items():  # rank 0 as a launcher starts it
        monkeypatch.setenv(name, value)
    trainer = Trainer(layout="pp=2", max_steps=1, pp_schedule="zero-bubble",
                      activation_checkpointing="selective", global_batch_size=16,
                      progress_bar=False)
    with pytest.raises(ConfigError, match="'zero-bubble' with activation_checkpointing="
                                          "'selective' fails in torch 2.13"):
        trainer.fit(tiny_gpt_4_layers, token_data(), optimizer=adamw_gpt,
                    loss_fn=lambda out, y: out.sum())
