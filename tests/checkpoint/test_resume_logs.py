"""A resumed run's per-step files hold each step once: the rows an earlier attempt logged past the
checkpoint it resumes from are dropped, as the checkpoint's state is, and logged again by the
resumed run (metrics.csv, TensorBoard, breakdown.csv, an MoE model's experts.jsonl);
events.jsonl keeps the whole history. (A real SIGKILL and restart under `meshtrain run`:
tests/fault/test_restarts.py checks metrics.csv and breakdown.csv against an uninterrupted run.)"""

import json

import pytest
from parity import SEQ, VOCAB, adamw_gpt, lm_loss, token_data

from meshtrain import Callback, Trainer
from meshtrain.observe.loggers import read_metrics_csv
from meshtrain.observe.run_files import read_breakdown, read_events, read_expert_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Crashed(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, trainer, metrics):
        if trainer.global_step == self.step:
            raise Crashed(f"stopped at step {self.step}")


def moe_gpt():
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=2, d_model=16,
                         bias=False, num_experts=4, experts_per_token=1), seed=0)


def _fit(run_dir, crash_at=None):
    trainer = Trainer(run_dir=run_dir, max_steps=7, global_batch_size=8, seed=0,
                      loggers=("csv", "tensorboard"), log_every_n_steps=1, progress_bar=False,
                      model_summary=False, report=False, checkpoint_every_n_steps=2,
                      callbacks=[CrashAt(crash_at)] if crash_at else [])
    try:
        trainer.fit(moe_gpt, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    except Crashed:
        pass
    return trainer


def _tensorboard_steps(run_dir, tag="train/loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


@pytest.mark.timeout(120)
def test_a_resumed_run_logs_each_step_once(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _fit(run_dir, crash_at=6)  # checkpoints at steps 2 and 4; steps 1..5 logged
    assert [r["step"] for r in read_metrics_csv(run_dir / "metrics.csv")] == [1, 2, 3, 4, 5]
    trainer = _fit(run_dir)  # resumed from step 4: step 5 again, then 6 and 7
    assert trainer.global_step == 7
    assert "metrics.csv: 1 row(s) of the steps after 4, logged before the stop, dropped" in \
        capsys.readouterr().out
    steps = list(range(1, 8))
    assert [r["step"] for r in read_metrics_csv(run_dir / "metrics.csv")] == steps
    assert [r["step"] for r in read_breakdown(run_dir)] == steps
    assert [r["step"] for r in read_expert_load(run_dir)] == steps
    assert _tensorboard_steps(run_dir) == steps
    # events.jsonl: the history (checkpoints 2, 4, then the resume at 4, then 6), every line
    kinds = [(e["kind"], e["step"]) for e in read_events(run_dir)]
    assert [k for k in kinds if k[0] in ("checkpoint", "restart")][:4] == [
        ("checkpoint", 2), ("checkpoint", 4), ("restart", 4), ("checkpoint", 6)], kinds
    assert all(json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines())
