"""A Hugging Face MoE model's expert load and FLOPs, as a user's fit records them: its routers'
picks counted per layer (models/hf/moe_metrics.py) into the same metrics, experts.jsonl and
report section as meshtrain's own MoE, summed over the data-parallel ranks (ep=2 on 2
processes counts what one process counts); MFU on the active parameters (a token runs k of
the E experts: observe/flops.py); the report and fit's summary name the most imbalanced
layer of the last logged steps (observe/report/experts.py)."""

import json
import re
from functools import partial

import pytest
import torch
from conftest import quiet_trainer

from meshtrain.launch.spawn import run_workers
from meshtrain.models.hf import random_token_data, tiny_causal_lm
from meshtrain.observe import run_files
from meshtrain.observe.flops import count_flop_params, flops_per_item
from meshtrain.observe.loggers import read_metrics_csv
from meshtrain.observe.report import write_report

torch.set_num_threads(1)
BATCH, SEQ, LAYERS, EXPERTS, TOP_K, STEPS = 8, 16, 2, 4, 2, 3


def qwen3_moe(router_loss: bool = True):
    return tiny_causal_lm("Qwen3Moe", moe_intermediate_size=8, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, vocab_size=32, hidden_size=16,
                          num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=8, max_position_embeddings=SEQ,
                          output_router_logits=router_loss)


def active_params() -> float:
    """The parameters a token runs: all but the embedding table, the experts' k of E."""
    with torch.device("meta"):
        model = qwen3_moe()
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert experts > 0.4 * sum(p.numel() for p in params.values())
    return sum(p.numel() for n, p in params.items() if "embed_tokens" not in n) - \
        experts * (1 - TOP_K / EXPERTS)


def active_formula() -> float:
    """6 x the active parameters + attention's 12 L (heads x head_dim) T."""
    return 6 * active_params() + 12 * LAYERS * (2 * 8) * SEQ


def fit(run_dir, layout: str | None, router_loss: bool):
    """A user's fit (every rank of a job runs it)."""
    trainer = quiet_trainer(run_dir, layout=layout, max_steps=STEPS, global_batch_size=BATCH,
                            log_every_n_steps=1, shuffle=False, loggers=("csv",), report=True)
    trainer.fit(partial(qwen3_moe, router_loss), random_token_data(),
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    return run_dir


def check_run(run_dir) -> list[dict]:
    """What a fit of the tiny Qwen3-MoE leaves: per step and layer, the picks of every rank's
    tokens (tokens x k) in experts.jsonl and as moe/ metrics, the report's Experts section
    naming the worst layer, MFU from the active-parameter FLOPs. Returns experts.jsonl's rows."""
    rows = run_files.read_expert_load(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert len(row["counts"]) == LAYERS
        assert all(sum(layer) == BATCH * SEQ * TOP_K for layer in row["counts"]), row
    metrics = [m for m in read_metrics_csv(run_dir / "metrics.csv") if m.get("train/loss")]
    assert metrics[-1]["moe/layer1/tokens_max"] == max(rows[-1]["counts"][1])
    report = (run_dir / "report.html").read_text()
    experts = report.split('<section id="experts">')[1].split("</section>")[0]
    assert '<img src="data:image/png;base64,' in experts and "No experts" not in experts
    assert re.search(r"Layer \d is the most imbalanced over the last 3 logged steps", experts)
    flops = json.loads((run_dir / run_files.ENVIRONMENT).read_text())["flops_per_item"]
    assert abs(flops / active_formula() - 1) < 0.05, (flops, active_formula())
    world = json.loads((run_dir / run_files.ENVIRONMENT).read_text())["world_size"]
    last = metrics[-1]
    assert last["train/tflops"] == pytest.approx(
        flops * last["train/tokens_per_s"] / world / 1e12, rel=1e-6)
    return rows


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_thread")
def test_a_hugging_face_moe_fit_records_its_expert_load_and_active_flops(tmp_path, capsys):
    # one process, the router loss off: the picks come from the routers' own outputs
    alone = check_run(fit(tmp_path / "one", None, router_loss=False))
    summary = capsys.readouterr().out
    assert re.search(r"experts: layer \d is the most imbalanced over the last 3 logged steps "
                     r"\(steps 1-3\)", summary), summary
    # ep=2 on 2 processes, with the router loss: each rank routes half the batch and the
    # counts are summed over both (the first step's routing is the same model on the same data)
    run_workers(fit, 2, (tmp_path / "ep", "ep=2", True), timeout=200)
    split = check_run(tmp_path / "ep")
    assert split[0]["counts"] == alone[0]["counts"]


def test_flops_count_the_experts_a_token_runs():
    """Counted on meta (transformers' experts loop over the experts hit with .nonzero(): they
    are counted as 6 x tokens x k x one expert instead) and the 6 x parameters estimate alike:
    k/E of the expert weights, within 5% of the active-parameter formula."""
    from meshtrain.observe.flops import counted_flops_per_item

    with torch.device("meta"):
        model = qwen3_moe()
    sample = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long),
              "labels": torch.zeros(2, SEQ, dtype=torch.long)}
    counted = counted_flops_per_item(model, sample)
    assert counted is not None and abs(counted / active_formula() - 1) < 0.05, counted
    assert flops_per_item(model) == 6 * active_params() < 0.75 * 6 * count_flop_params(model)
    assert not any("forward" in vars(m) for m in model.modules())  # the experts' own again


def test_the_report_names_the_layer_that_collapsed_in_the_last_steps(tmp_path):
    """Layer 0 is mildly imbalanced all along; layer 2 balanced for 20 steps, then all its
    tokens on 2 experts for the last 4: summed over the run layer 0 looks worst, the last
    steps name layer 2."""
    run = tmp_path / "run"
    run.mkdir()
    run_files.update_environment(run, world_size=1, status="finished")
    tokens = 64
    for step in range(1, 25):
        collapsed = step > 20
        counts = [[24, 16, 12, 12], [16, 16, 16, 16],
                  [32, 32, 0, 0] if collapsed else [16, 16, 16, 16], [17, 15, 16, 16]]
        assert all(sum(layer) == tokens for layer in counts)
        run_files.append_expert_load(run, step, counts)
    page = write_report(run).read_text()
    experts = page.split('<section id="experts">')[1].split("</section>")[0]
    text = " ".join(re.sub(r"<[^>]+>", " ", experts).split())
    assert "Layer 2 is the most imbalanced over the last 5 logged steps (steps 20-24): its " \
           "busiest expert took 1.80x the mean" in text, text
    assert "its top 2 experts 90% of its picks" in text
    assert "2 (most imbalanced)" in text and "0 (most imbalanced)" not in text
    run_total = re.search(r"<td>0</td><td class=\"num\">([\d.]+)</td>", experts)
    assert float(run_total.group(1)) == 1.5  # layer 0 is the run-summed table's busiest


def test_a_moe_gpts_flops_count_k_experts_whatever_rows_a_rank_holds():
    """meshtrain's MoE GPT states its own FLOPs: 6 x active parameters + 12 L d T, the same
    once ep has left each rank half the experts (MFU under ep=2 was counted on half of k)."""
    from meshtrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, seq_len=SEQ, num_layers=LAYERS, d_model=16,
                          num_heads=2, num_experts=EXPERTS, experts_per_token=TOP_K))
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    active = sum(p.numel() for n, p in params.items() if "emb" not in n) - experts / 2
    whole = model.flops_per_token()
    assert whole == 6 * active + 12 * LAYERS * 16 * SEQ
    for block in model.layers:  # what ep=2 leaves rank 1
        block.mlp.split_experts(1, 2)
    assert model.flops_per_token() == whole
