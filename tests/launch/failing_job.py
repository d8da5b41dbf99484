"""A two-process job that fails on purpose, for tests/launch/test_exit_codes.py. One file, three
ways in: ``python failing_job.py KIND RUN_DIR`` (Trainer(devices=2) starts rank 1),
``meshtrain run --nproc-per-node 2 failing_job.py KIND RUN_DIR``, and as the recipe
``failing_job`` of ``meshtrain train`` (``[failure] kind``, ``[logging] run_dir``; the config
sets the Trainer's settings).

KIND: ``refuse`` (every rank raises a ConfigError at its first step, as a check of the data
against the layout does), ``raise`` (the model raises ValueError at step 2 on rank 1), ``kill``
(rank 1 is SIGKILLed at step 2), ``stop`` (rank 1 SIGSTOPs itself at step 2; the stall watchdog
is set to 2 s), ``none``. The report is written when ``FAILING_JOB_REPORT=1``
(the ``train`` entry: the config's ``[logging] report``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from parity import adamw, mlp, regression_data

from meshtrain import ConfigError, Trainer, settings

KINDS = ("refuse", "raise", "kill", "stop", "none")
REPORT_ENV = "FAILING_JOB_REPORT"  # "1": the Trainer's report on
REFUSAL = "this job refuses its data after start (a made-up check); fix: give it other data"


class Failing(torch.nn.Module):
    """The parity MLP, failing as ``kind`` says at the step it says."""

    def __init__(self, kind: str):
        super().__init__()
        self.net, self.kind, self.calls = mlp(), kind, 0

    def forward(self, x):
        self.calls += 1  # one micro-batch per step
        rank = int(os.environ["RANK"])
        if self.kind == "refuse":
            raise ConfigError(REFUSAL)
        if self.kind == "raise" and rank == 1 and self.calls == 2:
            raise ValueError("rank 1's model raised at step 2 (made up)")
        if self.kind == "kill" and rank == 1 and self.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stop" and rank == 1 and self.calls == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.net(x)


def train(kind: str, **settings_) -> None:
    """Every process writes its pid beside the run folder (``pids/``: the test ends them)."""
    assert kind in KINDS, kind
    pids = Path(settings_["run_dir"]).parent / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"{os.getpid()}.pid").write_text(str(os.getpid()))
    keywords = dict(layout="dp=2", devices=2, accelerator="cpu", max_steps=3,
                    global_batch_size=16, loggers=(), progress_bar=False, model_summary=False,
                    report=os.environ.get(REPORT_ENV) == "1", save_final_checkpoint=False,
                    seed=0)
    if kind == "stop":  # the stall watchdog finds it (from step 2 on: it skips the first)
        keywords["stall_timeout_s"] = 2.0
    trainer = Trainer(**{**keywords, **settings_})
    trainer.fit(Failing(kind), regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    trainer.print(f"TRAINED {trainer.global_step} steps")


# -- as a recipe (meshtrain train) ----------------------------------------------------------------
DEFAULTS = {"job": {"recipe": "failing_job"}, **settings.config_sections(),
            "failure": {"kind": "none"}}


def run(config: dict, mode: str = "train") -> None:
    train(config["failure"]["kind"], **settings.flatten(config))


if __name__ == "__main__":
    torch.set_num_threads(1)
    train(sys.argv[1], run_dir=sys.argv[2])
