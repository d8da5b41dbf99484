"""Tensor parallel (Megatron) and sequence parallel without the Trainer: apply_tp must reproduce
one-process training, alone (tp=2) and under FSDP2 (dp=2 x tp=2), and issue Megatron's number
of collectives. Each multi-process test spawns its ranks once and runs all its cases there."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_matches_one_process, gloo_mesh, max_diff

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.data.meta_init import materialize
from meshtrain.parallel.tensor.tensor_parallel import (
    ReplicateParallel, apply_tp, check_tp, complete_partial_grads, full_value, model_tp_plan,
    loss_parallel_context, mlp_plan,
)
from meshtrain.parallel.tensor.tp_debug import comm_counts

CONFIG = dict(vocab_size=16, seq_len=8, num_layers=2, d_model=16, num_heads=2, mlp_ratio=4)
STEPS, DP_TP_STEPS, BATCH, LR = 10, 5, 8, 1e-3
VARIANTS = {  # name -> apply_tp options
    "tp": dict(),
    "tp+sp": dict(sequence_parallel=True),
    "tp+loss_parallel": dict(loss_parallel=True),
}


def tiny_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}))


def meta_gpt(**overrides) -> GPT:
    with torch.device("meta"):
        return tiny_gpt(**overrides)


def batches(steps: int):
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, CONFIG["vocab_size"], (steps, BATCH, CONFIG["seq_len"]), generator=gen)
    return x, (3 * x + 1) % CONFIG["vocab_size"]  # a learnable map: the loss must fall


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(model: nn.Module, steps: int, part: slice = slice(None),
          loss_parallel: bool = False) -> list[float]:
    """AdamW steps; every TP rank sees the same (part of the) batch, as a TP group must."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = batches(steps)
    losses = []
    for step in range(steps):
        with loss_parallel_context(loss_parallel):  # loss *and* backward inside
            loss = lm_loss(model(x[step, part]), y[step, part])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(full_value(loss).item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: every rank must call it)."""
    return {n: full_value(p).detach().clone() for n, p in model.named_parameters()}


@functools.cache
def reference_run(steps: int) -> tuple[dict, list[float]]:
    """One process on the full batch (computed once per steps value)."""
    model = tiny_gpt()
    initial = full_params(model)
    losses = train(model, steps)
    final = full_params(model)
    assert max_diff(initial, final) > 1e-3, "training barely moved: the test would prove nothing"
    assert losses[-1] < losses[0]
    return final, losses


# ---------------------------------------------------------------------------------------------
# One process: checks and plans (meta device, no process group)
# ---------------------------------------------------------------------------------------------
def test_check_tp_accepts_divisible_sizes():
    check_tp(meta_gpt(), 2, sequence_parallel=True)
    check_tp(meta_gpt(num_heads=3, d_model=24, vocab_size=17, seq_len=7), 1, sequence_parallel=True)
    check_tp(meta_gpt(seq_len=7), 2, sequence_parallel=False)  # the sequence is not split
    check_tp(meta_gpt(seq_len=7), 2, sequence_parallel=True, seq_len=6)  # batches are shorter


@pytest.mark.parametrize("overrides, tp, sp, match", [
    (dict(num_heads=3, d_model=24), 2, False,
     r"num_heads=3 is not divisible by 2.*\(1, 3\).*e\.g\. 4"),
    (dict(vocab_size=17), 2, False,
     r"vocab_size=17 is not divisible by 2.*multiple of 2 \(e\.g\. 18\)"),
    (dict(seq_len=7), 2, True, r"seq_len=7 is not divisible by 2.*sequence_parallel off"),
    (dict(num_heads=4, d_model=16, mlp_ratio=1), 8, False, r"num_heads=4 is not divisible by 8"),
    (dict(), 0, False, r"tp must be a positive integer"),
])
def test_check_tp_names_the_size_and_the_fix(overrides, tp, sp, match):
    with pytest.raises(ConfigError, match=match):
        check_tp(meta_gpt(**overrides), tp, sequence_parallel=sp)


def test_gpt_plan_covers_every_parameter_and_prepares_the_first_block_only():
    model = meta_gpt(num_layers=3)
    for sp in (False, True):
        plan = model.tp_plan(2, sequence_parallel=sp, loss_parallel=False)  # the model's own
        owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
        assert owners <= plan.keys(), f"not in the plan: {owners - plan.keys()}"
        assert ("layers.0" in plan) == sp and "layers.1" not in plan and "layers.2" not in plan
        assert isinstance(plan["pos_emb"], ReplicateParallel)
        # norms: whole with the stream replicated, on its sequence shard under sp
        assert isinstance(plan["layers.1.norm1"], ReplicateParallel)
        assert plan["layers.1.norm1"].local_input == sp
    with pytest.raises(ConfigError, match=r"Linear has no tensor-parallel plan: pass Trainer\(tp_plan="):
        model_tp_plan(nn.Linear(2, 2), 2)
    check_tp(nn.Linear(2, 2), 2, sequence_parallel=False)  # no checks of its own: nothing to say


# ---------------------------------------------------------------------------------------------
# tp=2 on 2 ranks: parity of every variant, local head count, user plans, collective counts
# ---------------------------------------------------------------------------------------------
def _count(mesh, num_layers: int, **options) -> dict[str, int]:
    """One micro-batch's forward + backward, split as the Trainer splits (partial gradients
    left for the step), then the step's sum of the partial gradients ("step/all_reduce")."""
    model = apply_tp(tiny_gpt(num_layers=num_layers), mesh, **options, grads_per_step=True)
    x, y = batches(1)
    counts = comm_counts(model, (x[0], y[0]), lm_loss,
                         loss_parallel=options.get("loss_parallel", False))
    per_step = complete_partial_grads(model.parameters())
    return counts | ({"step/all_reduce": per_step} if per_step else {})


def _tp_rank():
    mesh = gloo_mesh((2,), ("tp",))
    out = {}
    for name, options in VARIANTS.items():
        model = apply_tp(tiny_gpt(), mesh, **options)
        losses = train(model, STEPS, loss_parallel=options.get("loss_parallel", False))
        out[name] = full_params(model), losses
    attn = apply_tp(tiny_gpt(), mesh).layers[0].attn
    out["local_heads"] = attn.wq.weight.to_local().shape[0] // attn.head_dim
    # A user plan from the generic helper, on a model apply_tp has no built-in plan for.
    mlp = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    expected = mlp(x).detach()
    with pytest.raises(ConfigError, match="Sequential has no tensor-parallel plan"):
        apply_tp(mlp, mesh)
    apply_tp(mlp, mesh, plan=mlp_plan("", "0", "2"))
    out["user_plan_diff"] = (mlp(x) - expected).abs().max().item()
    # Built on the meta device, split, then materialised: each rank fills only its shards.
    model = apply_tp(meta_gpt(), mesh, sequence_parallel=True)
    materialize(model, "cpu")
    out["meta_diff"] = max_diff(full_params(model), full_params(tiny_gpt()))
    with pytest.raises(ConfigError, match="this input has 7 tokens"):  # before any collective
        model(torch.zeros(1, 7, dtype=torch.long))
    out["counts"] = {(name, layers): _count(mesh, layers, **options)
                     for name, options in VARIANTS.items() for layers in (1, 2)}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module")
def tp_results():
    return run_workers(_tp_rank, 2, timeout=110)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_matches_one_process(tp_results, variant):
    reference, reference_losses = reference_run(STEPS)
    params, losses = tp_results[variant]
    assert_matches_one_process(reference, params, f"{variant} on 2 ranks")
    assert max(abs(a - b) for a, b in zip(losses, reference_losses)) <= 1e-6, (
        losses, reference_losses)


@pytest.mark.timeout(120)
def test_heads_split_user_plans_and_meta_construction(tp_results):
    assert tp_results["local_heads"] == CONFIG["num_heads"] // 2
    assert tp_results["user_plan_diff"] <= 1e-6
    assert tp_results["meta_diff"] == 0


@pytest.mark.timeout(120)
def test_collective_counts_match_megatron(tp_results):
    counts = tp_results["counts"]
    for layers in (1, 2):
        # Without SP: per block 2 all-reduces forward (after wo, fc_out) and 2 backward (input
        # gradients of q/k/v, summed once, and of fc_in) = Megatron's 4. Outside the blocks: the
        # vocab-parallel embedding's all-reduce (forward), the head's input-gradient all-reduce
        # (backward) and the all-gather of the logits over the vocabulary (forward).
        assert counts["tp", layers] == {
            "forward/all_reduce": 2 * layers + 1, "backward/all_reduce": 2 * layers + 1,
            "all_reduce": 4 * layers + 2, "forward/all_gather": 1, "all_gather": 1}
        # With SP each block all-reduce becomes reduce-scatter + all-gather (Megatron's 8 per
        # block). Forward: the embedding's all-reduce, 2 all-gathers + 2 reduce-scatters per
        # block, the head's input all-gather and the logits' all-gather. Backward: the same per
        # block, the head's input reduce-scatter, the first block's input all-gather. The
        # weight and bias gradients of the 2L+1 LayerNorms (from sequence shards) stay partial
        # and are summed once per step, in one all-reduce, as Megatron-LM's
        # finalize_model_grads does.
        assert counts["tp+sp", layers] == {
            "forward/all_reduce": 1, "forward/all_gather": 2 * layers + 2,
            "forward/reduce_scatter": 2 * layers,
            "backward/all_gather": 2 * layers + 1, "backward/reduce_scatter": 2 * layers + 1,
            "all_reduce": 1, "all_gather": 4 * layers + 3,
            "reduce_scatter": 4 * layers + 1, "step/all_reduce": 1}
        # Loss parallel: no logits all-gather; the sharded cross-entropy all-reduces 3 times
        # (max logit, sum of exponentials, the target's logit).
        assert counts["tp+loss_parallel", layers] == {
            "forward/all_reduce": 2 * layers + 4, "backward/all_reduce": 2 * layers + 1,
            "all_reduce": 4 * layers + 5}


# ---------------------------------------------------------------------------------------------
# dp=2 x tp=2 on 4 ranks: TP, then FSDP2 over "dp" (the Trainer's order)
# ---------------------------------------------------------------------------------------------
def _dp_tp_rank():
    from meshtrain.parallel.data.fully_shard import apply_fsdp

    mesh = gloo_mesh((2, 2), ("dp", "tp"))
    dp_rank, dp = mesh.get_local_rank("dp"), mesh["dp"].size()
    part = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # TP ranks: the same part
    with pytest.raises(ConfigError, match="needs the 1-D tensor-parallel mesh"):
        apply_tp(tiny_gpt(), mesh)
    out = {}
    for name in ("tp", "tp+sp"):
        model = apply_tp(tiny_gpt(), mesh["tp"], **VARIANTS[name])
        apply_fsdp(model, mesh["dp"])
        losses = torch.tensor(train(model, DP_TP_STEPS, part))
        torch.distributed.all_reduce(losses, group=mesh.get_group("dp"))  # mean of the halves
        out[name] = full_params(model), (losses / dp).tolist()
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.timeout(120)
def test_dp2_x_tp2_with_fsdp2_matches_one_process():
    results = run_workers(_dp_tp_rank, 4, timeout=110)[0]
    reference, reference_losses = reference_run(DP_TP_STEPS)
    for name, (params, losses) in results.items():
        assert_matches_one_process(reference, params, f"dp=2 x {name}=2 with FSDP2")
        assert max(abs(a - b) for a, b in zip(losses, reference_losses)) <= 1e-5
