"""Tensor-parallel layouts through the Trainer reproduce one-process training (a tiny GPT)."""

import pytest
import torch
from parity import GPT4_FNS, GPT_FNS, SEQ, VOCAB, assert_parity, sgd

from meshtrain.launch.spawn import run_workers


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options", [
    {}, dict(sequence_parallel=True), dict(loss_parallel=True),
])
def test_tp2_matches_one_process(options):
    assert_parity("tp=2", 2, steps=10, fns=GPT_FNS, parallel_kwargs=options)


@pytest.mark.timeout(200)
def test_sequence_parallel_with_gradient_accumulation_matches_one_process():
    # the norms' partial gradients stay partial through 4 micro-batches, summed once a step
    assert_parity("tp=2", 2, steps=5, fns=GPT_FNS, micro_batch_size=4,
                  parallel_kwargs=dict(sequence_parallel=True))


@pytest.mark.timeout(200)
def test_tp2_with_clipping():
    assert_parity("tp=2", 2, steps=10, fns=GPT_FNS, grad_clip_norm=0.05)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp=2,tp=2", "dp_shard=2,tp=2", "pp=2,tp=2"])
def test_tp2_composed_with_dp_or_pp_matches_one_process(layout):
    fns = GPT4_FNS if "pp" in layout else GPT_FNS
    assert_parity(layout, 4, steps=5, fns=fns, micro_batch_size=2 if "pp" in layout else None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp_shard=2,tp=2", "pp=2,tp=2"])
def test_sequence_parallel_composed_with_fsdp_or_pp_matches_one_process(layout):
    # the norms' partial gradients under FSDP2; a stage that hands on the whole sequence
    fns = GPT4_FNS if "pp" in layout else GPT_FNS
    assert_parity(layout, 4, steps=4, fns=fns, micro_batch_size=2 if "pp" in layout else None,
                  parallel_kwargs=dict(sequence_parallel=True))


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


# -- user models: what the plan leaves out, a wrong plan, a forward that mixes tensors ----------
class HeadNormNet(torch.nn.Module):
    """Regression through 4 'heads' of 4 units, each normalised by one LayerNorm(4): under tp
    the projection is split by heads, so the norm sees only this rank's heads."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 16)
        self.head_norm = torch.nn.LayerNorm(4)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.proj(x)
        h = self.head_norm(h.view(*h.shape[:-1], -1, 4)).flatten(-2)
        return self.out(torch.relu(h))


def _head_norm_plan(right: bool):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel

    plan = {"proj": ColwiseParallel(), "out": RowwiseParallel()}
    if right:  # the norm's gradient is each rank's share: summed over tp
        plan["head_norm"] = ReplicateParallel(local_input=True)
    return plan


HEAD_NORM_FNS = dict(model_fn=HeadNormNet, optimizer_fn=sgd)


def _wrong_plan_rank():
    from parity import train_state

    train_state(dict(layout="tp=2", max_steps=3, global_batch_size=16,
                     tp_plan=_head_norm_plan(right=False)), **HEAD_NORM_FNS)


@pytest.mark.timeout(120)
def test_a_replicated_norm_inside_a_split_region_stops_at_step_1_naming_it():
    """The plan leaves the per-head norm replicated: each rank's gradient is its heads' share.
    Training would run, slightly wrong; the first step's check stops it instead."""
    from meshtrain.errors import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"after step 1's backward the gradient of "
                                           r"head_norm\.(weight|bias), a parameter replicated"):
        run_workers(_wrong_plan_rank, 2, timeout=100)


class InNormNet(HeadNormNet):
    """HeadNormNet with a LayerNorm on its whole input, before the split projection."""

    def __init__(self):
        super().__init__()
        self.in_norm = torch.nn.LayerNorm(12)

    def forward(self, x):
        return super().forward(self.in_norm(x))


def _over_summed_rank():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from parity import train_state

    from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel

    # in_norm sees the whole input on every rank, but is declared to see a split one: its
    # gradient would be summed over the tp ranks, 2x on each (the gradients stay equal)
    plan = {"proj": ColwiseParallel(), "out": RowwiseParallel(),
            "head_norm": ReplicateParallel(local_input=True),
            "in_norm": ReplicateParallel(local_input=True)}
    train_state(dict(layout="tp=2", max_steps=3, global_batch_size=16, tp_plan=plan),
                **dict(HEAD_NORM_FNS, model_fn=InNormNet))


@pytest.mark.timeout(120)
def test_a_module_declared_to_see_split_inputs_that_sees_whole_ones_stops_at_step_1():
    """The class of wrong plan whose gradients agree across the tp ranks (each one tp times
    the true one), so the replicated-gradient check cannot see it: the inputs tell."""
    from meshtrain.errors import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"in step 1 in_norm received the same input on every "
                                           r"tp rank.*2x its gradient on every rank"):
        run_workers(_over_summed_rank, 2, timeout=100)


@pytest.mark.timeout(200)
def test_the_right_plan_for_the_norm_matches_one_process():
    # (tp under FSDP: the plain tp=2 case adds nothing the 4-rank one does not check)
    assert_parity("dp_shard=2,tp=2", 4, steps=6, fns=HEAD_NORM_FNS,
                  parallel_kwargs=dict(tp_plan=_head_norm_plan(right=True)))


class PositionalNet(torch.nn.Module):
    """A token model whose learned positions are an nn.Parameter on the root (as in many ViTs and
    GPTs), with its own tp_plan() method that names only the MLP."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, 16))
        self.fc_in, self.fc_out = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, idx):
        h = self.emb(idx) + self.pos[: idx.size(1)]
        return self.head(h + self.fc_out(torch.relu(self.fc_in(h))))

    def tp_plan(self, tp_degree, *, sequence_parallel=False, loss_parallel=False):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()}


POSITIONAL_FNS = dict(GPT_FNS, model_fn=PositionalNet)


@pytest.mark.timeout(200)
def test_a_root_parameter_and_a_tp_plan_method_match_one_process():
    """The model's own partial plan is completed like a Trainer(tp_plan=...) (it was refused:
    'left 22 parameter(s) plain'), and the root's positional parameter is replicated and seen
    as a plain tensor by the root's forward (it was refused after the processes started);
    under FSDP too (4 ranks: dp_shard=2,tp=2 covers what tp=2 alone did)."""
    assert_parity("dp_shard=2,tp=2", 4, steps=6, fns=POSITIONAL_FNS)


class DirectReadNet(PositionalNet):
    """Reads another module's parameter in its forward instead of calling the module."""

    def __init__(self):
        super().__init__()
        self.pos_emb = torch.nn.Embedding(SEQ, 16)

    def forward(self, idx):
        h = self.emb(idx) + self.pos_emb.weight[: idx.size(1)]
        return self.head(h + self.fc_out(torch.relu(self.fc_in(h))))


def _direct_read_rank():
    from parity import train_state

    train_state(dict(layout="tp=2", max_steps=1, global_batch_size=16),
                **dict(GPT_FNS, model_fn=DirectReadNet))


@pytest.mark.timeout(120)
def test_a_forward_that_reads_a_parameter_directly_is_told_what_to_change():
    from meshtrain.errors import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"reads another module's parameter directly(.|\n)*"
                                           r"Call the module instead"):
        run_workers(_direct_read_rank, 2, timeout=100)


@pytest.mark.parametrize("layout, streams", [
    ("dp=2,tp=2", [0, 0, 2, 2]), ("pp=2,tp=2", [0, 0, 2, 2]), ("tp=2,cp=2", [0, 0, 0, 0]),
    ("dp=2,cp=2", [0, 0, 2, 2]), ("dp=4", [0, 1, 2, 3]), ("pp=2,dp=2", [0, 1, 2, 3])])
def test_tp_and_cp_groups_share_a_random_stream_and_the_other_ranks_do_not(layout, streams):
    """Dropout's seed: a tp group's ranks hold the same activations outside the split parts, so
    they draw alike, and so do cp's (the same samples); data-parallel ranks and pipeline stages
    draw their own (a fake world of 4 ranks)."""
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.plan.simulate import fake_world

    seen = []
    for rank in range(4):
        with fake_world(4, rank):
            seen.append(ParallelMesh(Layout.parse(layout, 4), "cpu").random_rank)
    assert seen == streams


def _dropout_rank(run_dir, dropout):
    from conftest import quiet_trainer
    from parity import SEQ, VOCAB, lm_loss, token_data

    from meshtrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=2, d_model=16,
                       bias=False, dropout=dropout)
    trainer = quiet_trainer(run_dir, layout="tp=2", max_steps=4, global_batch_size=8,
                            model_summary=False)
    model = trainer.fit(lambda: GPT(config), token_data(), optimizer=sgd, loss_fn=lm_loss)
    norms = {n: getattr(p, "to_local", lambda: p)().detach().clone()  # (replicated DTensors)
             for n, p in model.named_parameters() if "norm" in n}
    return trainer.rank, norms


@pytest.mark.timeout(200)
def test_a_gpt_with_dropout_trains_under_tp_with_its_replicated_parts_alike(tmp_path):
    """Dropout under tp: the replicated activations draw the same masks on both ranks (before,
    each rank drew its own and the tp check refused the run in its first step), so the
    replicated weights stay equal; and dropout is on (the weights differ from dropout 0)."""
    ranks = run_workers(_dropout_rank, 2, (str(tmp_path / "on"), 0.2), timeout=150)
    (_, first), (_, second) = sorted(ranks, key=lambda r: r[0])
    assert first and first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    _, plain = min(run_workers(_dropout_rank, 2, (str(tmp_path / "off"), 0.0), timeout=150),
                   key=lambda r: r[0])
    assert any(not torch.allclose(first[n], plain[n]) for n in first)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("layout, ranks", [("tp=2", 2), ("pp=2,tp=2", 4)])
def test_sequence_parallel_with_recomputed_blocks_matches_one_process(layout, ranks, mode):
    """The first block slices the sequence-parallel stream in a pre-hook, and the checkpoint's
    recompute calls the block again: the checkpoint keeps the block's input from before the
    slice (it kept the slice, sliced it again in the recompute, and the first backward failed).
    A selective checkpoint's recompute may run only the operations its forward ran: the tp
    check's input hook skips the recompute (it added to its running sum there, and the first
    backward failed: "aten.add.Tensor invocation index 2 ... not found in storage")."""
    fns = GPT4_FNS if "pp" in layout else GPT_FNS
    assert_parity(layout, ranks, steps=4, fns=fns, micro_batch_size=2 if "pp" in layout else None,
                  parallel_kwargs=dict(sequence_parallel=True, activation_checkpointing=mode))
