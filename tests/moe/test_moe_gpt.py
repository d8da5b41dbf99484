"""meshtrain's own mixture-of-experts GPT (meshtrain/moe/layer.py, GPTConfig.num_experts):
dropless top-k routing, the load-balancing loss over the micro-step's global batch, bias
balancing from the step's global token counts; one process against every data-parallel layout
in float64 (tests/parity.py)."""

import pytest
import torch
from parity import (GRAD_NORMS, LOSSES, SEQ, VOCAB, adamw_gpt, assert_parity, lm_loss,
                    params_of, run_ranks, token_data)

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig

torch.set_num_threads(1)


def moe_gpt(**overrides):
    config = dict(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=2, d_model=16,
                  bias=False, num_experts=4, experts_per_token=2, router_aux_loss_coef=0.02)
    return GPT(GPTConfig(**{**config, **overrides}))


def moe_gpt_bias_balanced():
    return moe_gpt(router_bias_rate=1e-2, router_score="sigmoid", shared_expert=True)


MOE_FNS = dict(model_fn=moe_gpt, data_fn=token_data, loss_fn=lm_loss, optimizer_fn=adamw_gpt)


def test_dropless_routing_equals_each_token_through_its_experts():
    """The grouped, sorted computation is the per-token definition: sum over the token's k
    experts of weight x expert(token)."""
    torch.manual_seed(0)
    model = moe_gpt().double()
    moe = model.layers[0].mlp
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    weights, experts, _ = moe.router(x.reshape(-1, 16))
    want = torch.zeros(15, 16, dtype=torch.float64)
    for t, token in enumerate(x.reshape(-1, 16)):
        for w, e in zip(weights[t], experts[t]):
            hidden = torch.nn.functional.gelu(token @ moe.experts.w_in[e])
            want[t] += w * (hidden @ moe.experts.w_out[e])
    torch.testing.assert_close(moe(x), want.view(3, 5, 16), rtol=1e-12, atol=1e-12)


def test_an_expert_without_tokens_and_the_bias_only_picks():
    torch.manual_seed(0)
    moe = moe_gpt().layers[0].mlp
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, -100.0, -100.0]))  # 2, 3 never picked
    x = torch.randn(2, 4, 16)
    weights, experts, logits = moe.router(x.reshape(-1, 16))
    assert set(experts.flatten().tolist()) == {0, 1}
    torch.testing.assert_close(weights, logits.softmax(-1).gather(-1, experts))  # scores, not bias
    moe(x).sum().backward()  # experts 2 and 3 saw no token: zero gradient, no error
    assert moe.experts.w_in.grad[2:].abs().max() == 0 and moe.experts.w_in.grad[:2].abs().max() > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp=2", "zero1=2", "zero2=2", "zero3=2", "cp=2",
                                    "dp_replicate=2,dp_shard=2"])
def test_moe_gpt_matches_one_process(layout):
    assert_parity(layout, 4 if "," in layout else 2, steps=4, global_batch_size=16, fns=MOE_FNS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, devices, options", [
    ("tp=2", 2, {}),
    ("tp=2", 2, dict(sequence_parallel=True, loss_parallel=True)),  # (the loss a DTensor)
    ("dp_shard=2,tp=2", 4, dict(sequence_parallel=True, activation_checkpointing="selective")),
    ("cp=2,tp=2", 4, {})])
def test_tensor_parallel_splits_every_expert_and_matches_one_process(layout, devices, options):
    """tp splits each expert (and the shared expert) by hidden unit; the router, replicated,
    routes alike on every tp rank (meshtrain/moe/tensor_parallel.py). The balancing loss and
    the bias balancing with it."""
    assert_parity(layout, devices, steps=4, global_batch_size=16,
                  fns=dict(MOE_FNS, model_fn=moe_gpt_bias_balanced), parallel_kwargs=options)


def test_tensor_parallel_reduces_the_combined_output_not_the_routed_tokens():
    """A block's tp collectives (the planner's probe records them in a simulated world, a
    micro-batch of one sequence of T tokens): attention's two all-reduces of T x d, the MoE
    layer's output combined by the router weights (T x d, not the routed T x k x d), the routed
    tokens' gradient (T x k x d) and the weights' (T x k), float32."""
    from meshtrain.plan.model_spec import ModelSpec
    from meshtrain.plan.probe import probe_model

    tokens, d, k = 32, 64, 2
    spec = ModelSpec.load(f"gpt:num_layers=2,num_heads=4,d_model={d},vocab_size=256,"
                          f"seq_len={tokens},num_experts=4,experts_per_token={k}")
    comm = probe_model(spec, tp=2, cp=1, sequence_parallel=False, seq_len=tokens).block.comm
    assert all(c.op == "all_reduce" and c.axis == "tp" for c in comm)
    assert sorted(c.bytes for c in comm) == sorted(
        [tokens * d * 4] * 3 + [tokens * k * d * 4, tokens * k * 4])


def experts_compiled():
    """(``assert_parity``'s set-up, on each rank of the layout's run) The experts' calls that
    run eagerly on real tensors are counted; at the end of fit none may have."""
    from meshtrain import Callback
    from meshtrain.moe.layer import GroupedExperts

    eager, forward = [0], GroupedExperts.forward

    def counted(self, tokens, counts):
        if not tokens.is_meta and not torch.compiler.is_compiling():
            eager[0] += 1
        return forward(self, tokens, counts)

    class NoneEager(Callback):
        def on_fit_end(self, trainer):
            assert eager[0] == 0, f"the experts ran eagerly {eager[0]} times"

    GroupedExperts.forward = counted
    return [NoneEager()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, checkpointing", [("dp=2", "full"), ("zero3=2", "selective"),
                                                   ("dp_shard=2,ep=2", "full")])
def test_compiled_moe_blocks_with_checkpointing_match_one_eager_process(layout, checkpointing):
    """compile=True compiles each block with its experts (one grouped GEMM per weight over
    token offsets: shapes fixed by the batch); under ep the all-to-alls run between graphs and
    the local experts inside one. Before, the experts ran eagerly: a graph around their
    per-expert slices was recompiled as the counts changed, and the recompute under
    checkpointing picked another graph than the forward."""
    assert_parity(layout, 2, steps=4, global_batch_size=16, fns=MOE_FNS, setup=experts_compiled,
                  parallel_kwargs=dict(compile=True, activation_checkpointing=checkpointing))


@pytest.mark.timeout(300)
def test_bias_balancing_and_shared_expert_match_one_process_and_move_the_bias():
    from parity import train_state

    fns = dict(MOE_FNS, model_fn=moe_gpt_bias_balanced)
    assert_parity("dp=2", 2, steps=6, global_batch_size=16, fns=fns)
    state = train_state(dict(max_steps=3, global_batch_size=16), **fns)
    bias = state["layers.0.mlp.router.expert_bias"]
    assert bias.abs().max() > 0 and bias.sum().abs() < bias.abs().sum()  # moved both ways


@pytest.mark.timeout(300)
def test_the_balancing_loss_is_the_global_batchs_not_each_ranks():
    """Under dp=2 each rank's own balancing loss (its tokens alone) is not one process's:
    without the counts summed over the ranks the parity above would fail."""
    from meshtrain.moe.balance import RouterStats, balance_term

    torch.manual_seed(0)
    model = moe_gpt()
    with torch.no_grad():  # a router far from uniform (at init every expert gets ~1/E)
        for layer in model.layers:
            layer.mlp.router.gate.weight *= 30
    routing = model.router_loss()
    x = torch.randint(0, VOCAB, (8, SEQ))
    with routing.recording():
        model(x)
    whole = balance_term(routing.stats())
    shares = []
    for half in (x[:4], x[4:]):
        with routing.recording():
            model(half)
        shares.append(routing.stats())
    together = RouterStats(sum(s.counts for s in shares), None, sum(s.rows for s in shares))
    summed = sum(balance_term(RouterStats(together.counts, s.prob_sums, together.rows))
                 for s in shares)
    torch.testing.assert_close(summed, whole, rtol=1e-5, atol=0)
    alone = sum(balance_term(s) for s in shares) / 2
    assert (alone - whole).abs() > 1e-4


def test_bad_moe_configs_are_refused_before_start(tmp_path):
    from conftest import quiet_trainer

    with pytest.raises(ConfigError, match="experts_per_token=5 must be between 1 and "
                                          "num_experts=4"):
        moe_gpt(experts_per_token=5)
    with pytest.raises(ConfigError, match="router score must be one of"):
        moe_gpt(router_score="relu")
    # tp splits every expert by hidden unit
    trainer = quiet_trainer(tmp_path, layout="tp=2", devices=2, max_steps=1, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"splits the expert_hidden_dim over 2 ranks, but "
                                          r"expert_hidden_dim=15 is not divisible by 2"):
        trainer.check(lambda: moe_gpt(expert_hidden_dim=15), token_data(), optimizer=adamw_gpt,
                      loss_fn=lm_loss)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, devices", [("ep=2", 2), ("dp_shard=2,ep=2", 2),
                                             ("cp=2,ep=2", 2), ("dp=4,ep=2", 4)])
def test_expert_parallel_matches_one_process(layout, devices):
    """(dp=4,ep=2: the two ranks holding the same experts see other data; their experts'
    gradients are summed over them outside DDP, sync_expert_grads.)"""
    assert_parity(layout, devices, steps=6, global_batch_size=16, fns=MOE_FNS)


def adamw_foreach(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, devices", [("dp_shard=2,ep=2", 2),
                                             ("dp_replicate=2,dp_shard=2,ep=2", 4)])
def test_a_foreach_optimizer_and_clipping_under_sharded_expert_layouts(layout, devices):
    """What a GPU run does by default: AdamW's foreach step (CUDA's default; forced here) and
    clipping, over the dense part's FSDP2 DTensors and the experts together. Under
    dp_shard=2,ep=2 each expert has one rank (edp=1): its experts were plain tensors, which
    foreach ops refuse beside DTensors; FSDP2 over that one rank makes them DTensors, and the
    division its gradients need is meshtrain's (torch 2.13 divides a one-rank mesh's twice).
    Under HSDP the clip met DTensors of two meshes in one foreach op."""
    fns = dict(MOE_FNS, optimizer_fn=adamw_foreach)
    assert_parity(layout, devices, steps=4, global_batch_size=16, fns=fns, grad_clip_norm=0.05)


def moe_gpt_one_sided():
    """Every token routed to experts 2 and 3 (rank 1's under ep=2): rank 0 sends all its
    tokens away and its experts receive none."""
    model = moe_gpt(router_aux_loss_coef=0.0)
    for layer in model.layers:
        layer.mlp.router.expert_bias.copy_(torch.tensor([-100.0, -100.0, 0.0, 0.0]))
    return model


@pytest.mark.timeout(300)
def test_all_tokens_to_the_other_ranks_experts_and_experts_without_tokens():
    fns = dict(MOE_FNS, model_fn=moe_gpt_one_sided)
    assert_parity("ep=2", 2, steps=4, global_batch_size=16, fns=fns)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["dp_shard=4,ep=2", "dp_replicate=2,dp_shard=2,ep=2"])
def test_experts_split_in_two_and_sharded_over_the_other_two_ranks(layout):
    """4 processes: experts split over ranks (0, 1) and (2, 3), each half FSDP-sharded over the
    two ranks holding it, which see other data (their gradients summed over them). Under HSDP
    those two are the replicas: the dense part is sharded inside each pair and all-reduced
    across them, the experts sharded across them."""
    assert_parity(layout, 4, steps=4, global_batch_size=16, fns=MOE_FNS)


def test_bad_expert_layouts_are_refused_before_start(tmp_path):
    from conftest import quiet_trainer

    from parity import tiny_gpt

    cases = [("ep=2", 2, tiny_gpt, "has none meshtrain can split"),
             ("ep=2", 2, lambda: moe_gpt(num_experts=3, experts_per_token=1),
              r"ep=2 does not divide the 3 experts"),
             ("ep=4", 2, moe_gpt, r"ep=4 borrows its ranks from the data- and context-"
                                  r"parallel ranks, which are 2; ep must divide it"),
             ("tp=2,ep=2", 2, moe_gpt, r"combines with dp, dp_shard \(zero2/zero3\), dp_replicate "
                                       r"\(HSDP\), cp and pp, not with tp \(not yet"),
             ("pp=2,ep=2", 2, moe_gpt, r"ep=2 borrows its ranks .* which are 1")]
    for layout, devices, model, match in cases:
        with pytest.raises(ConfigError, match=match):  # (the layout's own: at Trainer())
            trainer = quiet_trainer(tmp_path, layout=layout, devices=devices, max_steps=1,
                                    global_batch_size=8)
            trainer.check(model, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    # compiled blocks with selective checkpointing, the experts FSDP2 units inside them: their
    # hooks ran differently in the recompute (every rank failed the first backward; before
    # and after the experts compiled with their blocks)
    compiled = dict(layout="dp_shard=4,ep=2", devices=4, max_steps=1, global_batch_size=8,
                    compile=True, activation_checkpointing="selective")
    for refused in (compiled, dict(compiled, layout="dp_shard=2,ep=2", devices=2),
                    dict(compiled, layout="zero2=2,ep=2", devices=2)):
        with pytest.raises(ConfigError, match=r"'selective' fails .* FSDP2 units of their own"):
            quiet_trainer(tmp_path, **refused).check(moe_gpt, token_data(), optimizer=adamw_gpt,
                                                     loss_fn=lm_loss)
    for allowed in (dict(compiled, activation_checkpointing="full"),  # (each trained, by hand)
                    dict(compiled, compile=False), dict(compiled, layout="zero2=4,ep=2"),
                    dict(compiled, layout="ep=2", devices=2)):
        quiet_trainer(tmp_path, **allowed).check(moe_gpt, token_data(), optimizer=adamw_gpt,
                                                 loss_fn=lm_loss)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("saved, resumed", [("ep=2", None), (None, "dp_shard=2,ep=2"),
                                            ("dp_replicate=2,dp_shard=2,ep=2", "ep=2"),
                                            ("ep=2", "dp_shard=4,ep=2"), ("tp=2", "ep=2"),
                                            ("ep=2", "dp_shard=2,tp=2")],
                         ids=["ep=2->1 process", "1 process->dp_shard=2,ep=2",
                              "HSDP,ep=2->ep=2", "ep=2->dp_shard=4,ep=2", "tp=2->ep=2",
                              "ep=2->dp_shard=2,tp=2"])
def test_a_checkpoint_resumes_under_another_expert_layout(tmp_path, saved, resumed):
    """3 steps under one layout, a checkpoint, 3 more under another = 6 steps in one process
    (the experts' weights and their AdamW state saved whole, read back as each rank's rows,
    or its FSDP shard of them under dp_shard=4,ep=2 and HSDP, or every expert's hidden units
    split by tp)."""
    from parity import F64_TOL, compare_ranks, run_ranks, train_state

    from meshtrain.parallel.layout import Layout

    def run(layout, steps, **kwargs):
        trainer = dict(max_steps=steps, global_batch_size=16, layout=layout, **kwargs)
        ranks = Layout.processes_of(layout) if layout else 1
        return run_ranks(trainer, ranks, timeout=200, float64=True, **MOE_FNS)

    reference = train_state(dict(max_steps=6, global_batch_size=16), float64=True, **MOE_FNS)
    run(saved, 3, run_dir=str(tmp_path / "first"), save_final_checkpoint=True)
    resumed_ranks = run(resumed, 6, run_dir=str(tmp_path / "second"),
                        resume=str(tmp_path / "first" / "checkpoints" / "final"))
    reference_tail = {k: v for k, v in reference.items() if not k.startswith("__")}
    compare_ranks(reference_tail, resumed_ranks, tol=F64_TOL, relative=True,
                  label=f"{saved or '1 process'} -> {resumed or '1 process'}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ep=2", "dp_shard=2,ep=2"])
def test_training_goes_on_after_a_checkpoint_under_expert_parallel(tmp_path, layout):
    """A checkpoint every 2 steps of 4 leaves the run equal to one process: saving once put
    the experts' optimizer state, as checkpoints hold it (whole-tensor DTensors), into the
    live optimizer, whose next step failed (examples/moe_gpt.toml stopped at step 101)."""
    from parity import F64_TOL, compare_ranks, run_ranks, train_state

    trainer = dict(max_steps=4, global_batch_size=16)
    reference = train_state(trainer, float64=True, **MOE_FNS)
    ranks = run_ranks(dict(trainer, layout=layout, checkpoint_every_n_steps=2,
                           run_dir=str(tmp_path)), 2, timeout=200, float64=True, **MOE_FNS)
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
    compare_ranks(reference, ranks, tol=F64_TOL, relative=True, label=layout)


def _memory_under(layout: str) -> tuple:
    import tempfile

    from meshtrain import Trainer
    from meshtrain.observe.memory.probe import memory_row
    from meshtrain.parallel.expert import expert_params

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, max_steps=1, global_batch_size=16, loggers=(),
                          progress_bar=False, report=False, save_final_checkpoint=False,
                          model_summary=False, run_dir=run_dir)
        model = trainer.fit(moe_gpt, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
        row = memory_row(model, trainer.optimizer, trainer.layout)
        experts = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                      for p in expert_params(model))  # (held here)
        # (after fit: the gradients are freed; parameters and optimizer state remain)
        return (row.measured.params + row.measured.optimizer,
                row.predicted.params + row.predicted.optimizer, experts)


@pytest.mark.timeout(300)
def test_expert_memory_per_rank_is_the_formulas():
    """Under ep each rank holds E / ep experts (parameters, gradients, AdamW's two moments:
    16 bytes each in fp32), sharded under zero3 over the edp ranks holding the same ones
    (dp_shard=4,ep=2: a quarter of every expert weight a rank), and its share of the rest:
    measured = predicted."""
    from meshtrain.launch.spawn import run_workers

    whole = sum(p.numel() for n, p in moe_gpt().named_parameters() if ".experts." in n)
    for layout, ranks in (("ep=2", 2), ("dp_shard=2,ep=2", 2), ("dp_shard=4,ep=2", 4)):
        for measured, predicted, experts in run_workers(_memory_under, ranks, (layout,),
                                                        timeout=200):
            assert experts == whole // ranks
            assert abs(measured / predicted - 1) < 0.01, (layout, measured, predicted)


@pytest.mark.timeout(300)
def test_fp16_under_expert_parallel_with_sharding_trains_as_without_ep():
    """dp_shard=2,ep=2 on 2 processes: each rank's experts (no other rank holds them) are
    DTensors of their own one-rank mesh beside the dense part's; while they were plain
    tensors the grad scaler's fused check-and-unscale refused the mix in the first step. The
    same job as dp_shard=2 without ep
    (the same sharded fp16 arithmetic, the experts only placed elsewhere): the same skipped
    steps (the first: the initial scale 2^16 overflows) and the same numbers to a small
    fraction of fp16's unit roundoff u = 2^-11 (the norm holds the experts' gradients, which
    a scaled gradient would show at 2^16 x). Measured: loss 8e-7 and 8.5e-6 (0.004 u), norm
    2e-5 and 3.8e-5 relative (0.08 u), parameters 3.3e-5 and, on a machine whose CPU has
    AVX512-FP16 and AMX (2026-12-01), one element of the 7,000 at 1.67 u, the rest within
    0.11 u: AdamW's update of an element whose gradient sits near eps flips with the
    rounding (tests/parity.py, adamw_gpt), so parameters are judged element by element: at
    most one in a thousand past u / 4, none past 4 u."""
    common = dict(max_steps=6, global_batch_size=16, log_grad_norm=True, precision="fp16-mixed")
    fns = dict(MOE_FNS, float64=False)
    split = run_ranks(dict(common, layout="dp_shard=2,ep=2"), 2, **fns)
    whole = run_ranks(dict(common, layout="dp_shard=2"), 2, **fns)
    u = 2.0 ** -11
    for rank, (got, want) in enumerate(zip(split, whole)):
        norms, expected = got[GRAD_NORMS], want[GRAD_NORMS]
        assert torch.equal(norms.isfinite(), expected.isfinite()), (rank, norms, expected)
        assert norms.isfinite().sum() == 5, (rank, norms)  # only the first step skipped
        finite = expected.isfinite()
        assert ((norms[finite] - expected[finite]).abs() / expected[finite]).max() < u / 8
        assert (got[LOSSES] - want[LOSSES]).abs().max() < u / 64, rank
    assert sorted(params_of(split[0])) == sorted(params_of(whole[0]))
    diffs = torch.cat([(split[0][k].double() - whole[0][k].double()).abs().flatten()
                       for k in params_of(whole[0])])
    assert (diffs > u / 4).sum() <= diffs.numel() // 1000 and diffs.max() < 4 * u, (
        int((diffs > u / 4).sum()), diffs.max().item())
