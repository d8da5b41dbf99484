"""Hugging Face mixture-of-experts models train like plain transformers (issue 52).

With ``output_router_logits=True`` transformers' loss is the token-mean cross-entropy plus
``router_aux_loss_coef`` x the load-balancing loss of the forward's tokens. meshtrain adds that
loss itself over the tokens of the whole micro-step, every data-parallel rank's together
(meshtrain/moe/balance.py): one process and every data-parallel layout given the same global
batch train exactly like transformers on that batch: the weights judged in float64 (1e-9
relative); the loss values to 1e-6, as transformers computes them in float32 (``logits.float()``).
"""

import pytest
import torch
from parity import LOSSES, adamw_gpt, compare_ranks, run_ranks

from meshtrain.errors import ConfigError
from meshtrain.models.hf import random_token_data, tiny_causal_lm
from meshtrain.parity import F64_TOL

torch.set_num_threads(1)
BATCH, STEPS = 8, 4
SIZES = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
             output_router_logits=True, router_aux_loss_coef=0.02,
             experts_implementation="eager")  # (grouped_mm has no float64 on the CPU)


def qwen3_moe():
    return tiny_causal_lm("Qwen3Moe", moe_intermediate_size=8, num_experts=4,
                          num_experts_per_tok=2, **SIZES)


def mixtral():
    return tiny_causal_lm("Mixtral", intermediate_size=8, num_local_experts=4,
                          num_experts_per_tok=2, **SIZES)


def gpt_oss(seed: int = 0):
    """GPT-OSS stores its experts fused ([E, ...] tensors and biases), as the model holds them."""
    return tiny_causal_lm("GptOss", seed=seed, intermediate_size=8, num_local_experts=4,
                          num_experts_per_tok=2, **SIZES)


def plain_transformers(model_fn, steps: int = STEPS, batch_size: int = BATCH) -> dict:
    """The reference: transformers alone, in float64, each step on the next ``batch_size``
    samples (meshtrain with shuffle=False reads them in that order)."""
    model = model_fn().double()
    optimizer = adamw_gpt(model.parameters())
    data, losses = random_token_data(), []
    for step in range(steps):
        rows = range(step * batch_size, (step + 1) * batch_size)
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in ("input_ids", "labels")}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[LOSSES] = torch.tensor(losses, dtype=torch.float64)
    return state


def meshtrain_ranks(model_fn, layout: str | None, devices: int, steps: int = STEPS
                    ) -> list[dict]:
    kwargs = dict(max_steps=steps, global_batch_size=BATCH, shuffle=False, layout=layout)
    return run_ranks(kwargs, devices, timeout=200, model_fn=model_fn, data_fn=random_token_data,
                     loss_fn=None, optimizer_fn=adamw_gpt, float64=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_fn", [qwen3_moe, mixtral], ids=["Qwen3Moe", "Mixtral"])
def test_the_router_loss_trains_like_plain_transformers_under_every_data_layout(model_fn):
    reference = plain_transformers(model_fn)
    moved = plain_transformers(model_fn, steps=1)
    assert max((reference[k] - moved[k]).abs().max().item() for k in moved if k != LOSSES) > 1e-3
    weights = {k: v for k, v in reference.items() if k != LOSSES}
    # ep: each rank holds half the experts of the fused tensors (the model's base_model_ep_plan)
    layouts = [(None, 1), ("dp=2", 2), ("zero3=2", 2), ("ep=2", 2), ("dp_shard=2,ep=2", 2)]
    if model_fn is qwen3_moe:  # (transformers' fused experts FSDP-sharded over edp=2)
        layouts.append(("dp_shard=4,ep=2", 4))
    else:  # HSDP: the dense part sharded in pairs, replicated across them; experts as above
        layouts.append(("dp_replicate=2,dp_shard=2,ep=2", 4))
    for layout, devices in layouts:
        ranks = meshtrain_ranks(model_fn, layout, devices)
        label = f"{model_fn.__name__} {layout or 'one process'}"
        compare_ranks(weights, ranks, tol=F64_TOL, relative=True, label=label)
        for rank in ranks:  # transformers sums its cross-entropy in float32 (logits.float())
            torch.testing.assert_close(rank[LOSSES], reference[LOSSES], rtol=1e-6, atol=0,
                                       msg=lambda m: f"{label}: the losses differ: {m}")


def test_the_balancing_loss_of_a_rank_is_its_share_of_the_global_batchs():
    """Two halves' shares (with the counts of both) add up to the whole batch's loss, and so
    do their gradients: the identity dp=2 relies on, checked without processes."""
    from meshtrain.moe.balance import RouterStats, balance_term, router_stats

    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
              for _ in range(2)]
    whole = balance_term(router_stats(logits, 4, 2))
    halves = [router_stats([x[part] for x in logits], 4, 2) for part in (slice(0, 6),
                                                                            slice(6, 10))]
    total = RouterStats(sum(h.counts for h in halves), None, sum(h.rows for h in halves))
    shares = [balance_term(RouterStats(total.counts, h.prob_sums, total.rows)) for h in halves]
    assert torch.allclose(sum(shares), whole, rtol=1e-6)
    whole_grads = torch.autograd.grad(whole, logits)
    share_grads = torch.autograd.grad(sum(shares), logits)
    for a, b in zip(whole_grads, share_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
        assert a.abs().max() > 0
    # each half alone (transformers' per-forward loss) is not the whole batch's
    alone = sum(balance_term(h) for h in halves) / 2
    assert not torch.allclose(alone, whole, rtol=1e-4)


def test_a_router_loss_under_pp_is_refused_before_start(tmp_path):
    from conftest import quiet_trainer

    data = random_token_data()
    trainer = quiet_trainer(tmp_path, layout="pp=2", devices=2, max_steps=2, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM routes tokens to experts.*"
                                          r"\(config\.output_router_logits\).*Drop pp "
                                          r"\(dp, zero1/2/3 and ep carry it\)"):
        trainer.check(qwen3_moe, data, optimizer=adamw_gpt)


def test_a_transformers_whose_balancing_loss_changed_is_refused(monkeypatch):
    """meshtrain compares its copy with the model's own load_balancing_loss_func before
    start: a transformers that computes it otherwise is refused, not trained differently."""
    import sys

    from meshtrain.models.hf import hf_router_loss

    model = qwen3_moe()
    module = sys.modules[type(model).__module__]
    original = module.load_balancing_loss_func
    assert hf_router_loss(model) is not None
    monkeypatch.setattr(module, "load_balancing_loss_func",
                        lambda *args: original(*args) * 2)
    with pytest.raises(ConfigError, match="computes something else than meshtrain's copy"):
        hf_router_loss(model)



def _init_from_under(folder, run_root, layout, build):
    """init_from under ``layout``, one step at learning rate 0: the final checkpoint holds the
    folder's weights, whatever the layout did with them."""
    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(layout=layout, max_steps=1, global_batch_size=4, init_from=str(folder),
                      root_dir=str(run_root), name="from_hf", loggers=(), progress_bar=False,
                      resume=None, seed=0, report=False)
    trainer.fit(build, random_token_data(), optimizer=lambda params: torch.optim.SGD(params, lr=0))
    return str(trainer.run_dir)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_fn, layout, devices", [
    (qwen3_moe, "ep=2", 2), (mixtral, "ep=2", 2), (qwen3_moe, "zero3=2", 2),
    (mixtral, "dp_shard=4,ep=2", 4), (gpt_oss, "dp_shard=2,ep=2", 2)],
    ids=["Qwen3Moe-ep=2", "Mixtral-ep=2", "Qwen3Moe-zero3=2", "Mixtral-dp_shard=4,ep=2",
         "GptOss-dp_shard=2,ep=2"])
def test_a_moe_folder_round_trips(tmp_path, model_fn, layout, devices):
    """A saved MoE folder (transformers writes each expert apart) -> Trainer(init_from=...)
    (each rank reads only its experts and fuses them; dp_shard=4,ep=2: then FSDP shards them
    over the two ranks holding the same; dp_shard=2,ep=2: FSDP2's over one rank, its biases
    too) -> checkpoint -> export_hf (the experts written apart
    again): every tensor identical, under the same names; from_pretrained of the export gives
    the folder's logits."""
    import transformers
    from safetensors.torch import load_file

    from meshtrain.checkpoint.hf_export import export_hf
    from meshtrain.launch.spawn import run_workers

    source = model_fn()
    source.save_pretrained(tmp_path / "hf")
    build = MODEL_WITH_OTHER_WEIGHTS[model_fn.__name__]
    run_dir = run_workers(_init_from_under, devices, (tmp_path / "hf", tmp_path / "runs",
                                                       layout, build), timeout=250)[0]
    out = export_hf(f"{run_dir}/checkpoints/final", tmp_path / "out", config=tmp_path / "hf")
    saved, exported = load_file(tmp_path / "hf" / "model.safetensors"), {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(saved) == sorted(exported)
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    # stored apart (GPT-OSS: fused, as the model holds them)
    assert any(".experts.3." in k for k in saved) == (model_fn is not gpt_oss)
    own = build().state_dict()
    assert any(not torch.equal(own[k], v) for k, v in source.state_dict().items())
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, source(input_ids=ids).logits)


def qwen3_moe_seed7():
    return tiny_causal_lm("Qwen3Moe", seed=7, moe_intermediate_size=8, num_experts=4,
                          num_experts_per_tok=2, **SIZES)


def mixtral_seed7():
    return tiny_causal_lm("Mixtral", seed=7, intermediate_size=8, num_local_experts=4,
                          num_experts_per_tok=2, **SIZES)


def gpt_oss_seed7():
    return gpt_oss(seed=7)


MODEL_WITH_OTHER_WEIGHTS = {"qwen3_moe": qwen3_moe_seed7, "mixtral": mixtral_seed7,
                            "gpt_oss": gpt_oss_seed7}


def test_the_validation_loss_is_the_cross_entropy_alone(tmp_path):
    """The balancing loss trains the router; val/loss is the language model's cross-entropy
    (transformers' own loss with output_router_logits=False), not plus the router term."""
    from conftest import quiet_trainer

    model = qwen3_moe()
    data = random_token_data(num_samples=16)
    batch = {k: torch.stack([data[i][k] for i in range(16)]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        with_router = model(**batch).loss
        alone = model(**batch, output_router_logits=False).loss
    assert with_router - alone > 1e-3  # the router term is there to leave out
    trainer = quiet_trainer(tmp_path, max_steps=1, global_batch_size=16)
    trainer.fit(qwen3_moe, data, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    assert trainer.validate(data)["val/loss"] == pytest.approx(float(alone), rel=1e-6)


def deepseek_v3():
    """A tiny DeepSeek-V3: sigmoid routing picked with an e_score_correction_bias, which
    meshtrain moves (config.router_bias_rate; transformers never does)."""
    return tiny_causal_lm(  # (seed 1: every bias ends non-zero, some up and some down)
        "DeepseekV3", seed=1, vocab_size=32, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, experts_implementation="eager",
        router_bias_rate=0.05)


def plain_transformers_moving_the_bias(steps: int = STEPS) -> dict:
    """The reference: transformers in float64, and after each step every router's bias moved
    by ``rate * sign(mean - count)`` of that step's picks (DeepSeek-V3's update), by hand."""
    model = deepseek_v3().double()
    rate = model.config.router_bias_rate
    optimizer = adamw_gpt(model.parameters())
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    counts = {}
    for router in routers:
        router.register_forward_hook(lambda m, a, out: counts.__setitem__(
            m, counts.get(m, 0) + torch.bincount(out[-1].reshape(-1), minlength=4)))
    data = random_token_data()
    for step in range(steps):
        rows = range(step * BATCH, (step + 1) * BATCH)
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in ("input_ids", "labels")}
        counts.clear()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for router in routers:
                c = counts[router].double()
                router.e_score_correction_bias += rate * torch.sign(c.mean() - c)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(400)
def test_deepseek_v3s_routing_bias_moves_as_by_hand_under_every_data_layout():
    """(3 steps: an odd number of +-rate moves leaves no bias at zero.) DeepSeek-V3 computes
    its router in float32 on purpose (``_keep_in_fp32_modules_strict``: the gate's weight and
    bias), so a layout that sums the gate's gradient in another order lands ~3e-8 apart (the
    model's own floor); one process is exact."""
    reference = plain_transformers_moving_the_bias(steps=3)
    biases = [v for k, v in reference.items() if k.endswith("e_score_correction_bias")]
    assert all(b.abs().min() > 0 and (b > 0).any() and (b < 0).any() for b in biases), biases
    for layout, devices in ((None, 1), ("dp=2", 2), ("ep=2", 2)):
        ranks = meshtrain_ranks(deepseek_v3, layout, devices, steps=3)
        compare_ranks(reference, ranks, tol=F64_TOL if layout is None else 1e-6, relative=True,
                      label=f"DeepseekV3 {layout or 'one process'}")


def test_a_routing_bias_rate_without_a_bias_is_refused():
    from meshtrain.models.hf import hf_router_loss

    model = tiny_causal_lm("Qwen3Moe", moe_intermediate_size=8, num_experts=4,
                           num_experts_per_tok=2, **{**SIZES, "output_router_logits": False},
                           router_bias_rate=0.01)
    with pytest.raises(ConfigError, match="router_bias_rate=0.01, which moves the routers' "
                                          "e_score_correction_bias .* its routers have none"):
        hf_router_loss(model)


def deepseek_v3_one_sided():
    """Every token routed to experts 2 and 3 (rank 1's under ep=2): rank 0's experts get none,
    and transformers' experts forward then builds its output from zeros alone."""
    model = deepseek_v3()
    model.config.router_bias_rate = 0.0
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.tensor([-100.0, -100.0, 0.0, 0.0]))
    return model


@pytest.mark.timeout(300)
def test_experts_that_get_no_token_under_ep_neither_hang_nor_differ():
    """(It failed before: the rank whose experts got nothing skipped the backward's
    all-to-all, and the other rank's next collective read the wrong message.)"""
    picks = []
    model = deepseek_v3_one_sided()
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.register_forward_hook(lambda m, a, out: picks.append(out[-1]))
    model(input_ids=torch.randint(0, 32, (2, 8)))
    assert set(torch.cat(picks).flatten().tolist()) == {2, 3}
    reference = plain_transformers(deepseek_v3_one_sided, steps=3)
    reference.pop(LOSSES)
    ranks = meshtrain_ranks(deepseek_v3_one_sided, "ep=2", 2, steps=3)
    compare_ranks(reference, ranks, tol=1e-6, relative=True, label="one-sided ep=2")


def deepseek_v3_narrow_values():
    return tiny_causal_lm(
        "DeepseekV3", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, intermediate_size=16,
        moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, experts_implementation="eager")


@pytest.mark.timeout(300)
def test_deepseek_v3s_latent_attention_under_cp_trains_like_plain_transformers():
    """Context parallel gathers keys and values in one collective: values narrower than the
    keys (MLA) travel zero-padded (it failed before: torch.stack of unequal widths)."""
    reference = plain_transformers(deepseek_v3_narrow_values, steps=3)
    reference.pop(LOSSES)
    ranks = meshtrain_ranks(deepseek_v3_narrow_values, "cp=2", 2, steps=3)
    compare_ranks(reference, ranks, tol=1e-6, relative=True, label="DeepseekV3 MLA cp=2")


@pytest.mark.timeout(300)
def test_gpt_oss_experts_with_biases_train_like_plain_transformers_under_ep():
    """GPT-OSS's experts have biases ([E, ...] beside the weights): ep splits them with the
    weights (before, each rank kept all the biases and its experts used rows 0.. of them)."""
    reference = plain_transformers(gpt_oss, steps=3)
    reference.pop(LOSSES)
    ranks = meshtrain_ranks(gpt_oss, "ep=2", 2, steps=3)
    compare_ranks(reference, ranks, tol=F64_TOL, relative=True, label="GptOss ep=2")


def qwen3_moe_router_loss_off():
    return tiny_causal_lm("Qwen3Moe", moe_intermediate_size=8, num_experts=4,
                          num_experts_per_tok=2, **{**SIZES, "output_router_logits": False})


@pytest.mark.timeout(400)
def test_a_moe_model_without_router_loss_trains_like_transformers_under_pipelines():
    """(The router loss is refused under pp; the model without it is not: pipeline stages
    with transformers' fused experts, also split over ep.)"""
    reference = plain_transformers(qwen3_moe_router_loss_off, steps=3)
    reference.pop(LOSSES)
    for layout, devices in (("pp=2", 2), ("pp=2,ep=2", 4)):
        ranks = meshtrain_ranks(qwen3_moe_router_loss_off, layout, devices, steps=3)
        compare_ranks(reference, ranks, tol=F64_TOL, relative=True, label=f"Qwen3Moe {layout}")
