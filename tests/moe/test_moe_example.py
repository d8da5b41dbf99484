"""examples/moe_gpt.toml as a user runs it: `meshtrain train` on 2 processes under ep=2, the
experts' load and the balancing loss logged, a checkpoint, the closing sample."""

import json

import pytest
from test_cli import FINAL, ROOT, TINY, meshtrain

from meshtrain.observe.loggers import read_metrics_csv

STEPS = 12


@pytest.mark.timeout(200)
def test_the_moe_example_trains_under_expert_parallel_and_logs_the_load(tmp_path):
    config = ROOT / "examples" / "moe_gpt.toml"
    out = meshtrain("train", str(config), *TINY, f"--trainer.max_steps={STEPS}",
                    "--model.mlp_ratio=4", f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--- sample" in out.stdout and FINAL.findall(out.stdout)
    (run_dir,) = (tmp_path / "moe_gpt").iterdir()
    assert (run_dir / "checkpoints/final/.metadata").exists()
    rows = [r for r in read_metrics_csv(run_dir / "metrics.csv") if r.get("train/loss")]
    assert len(rows) == STEPS // 2
    tokens_per_step = 8 * 32 * 2  # global batch x seq_len x experts_per_token, over 8 experts
    for row in rows:
        assert row["moe/layer0/tokens_mean"] == pytest.approx(tokens_per_step / 8)
        assert row["moe/layer0/tokens_min"] <= row["moe/layer0/tokens_mean"] <= \
            row["moe/layer0/tokens_max"] <= tokens_per_step / 2  # (one token: 2 experts)
        assert 1 <= row["moe/imbalance"] <= 8
        assert 1.0 <= row["train/router_aux_loss"] < 8  # 1 when balanced
    # the report's layer x expert figure, from experts.jsonl (a line per logged step)
    lines = (run_dir / "experts.jsonl").read_text().splitlines()
    assert len(lines) == STEPS // 2
    last = json.loads(lines[-1])
    assert last["step"] == STEPS and sum(last["counts"][0]) == tokens_per_step
    assert max(last["counts"][0]) == rows[-1]["moe/layer0/tokens_max"]
    report = (run_dir / "report.html").read_text()
    experts = report.split('<section id="experts">')[1].split("</section>")[0]
    assert '<img src="data:image/png;base64,' in experts and "No experts" not in experts
