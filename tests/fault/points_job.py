"""The job of the fault-point, guard and SDC tests: fault_job.py's data and models, plus an MoE
GPT (``--model moe``, for ``ep``), the SDC check and a job folder without ``--run-dir``.

Faults come from ``MESHTRAIN_FAULT`` (meshtrain/fault/inject.py), not from switches here. As a
script (under ``meshtrain run``) or in-process through :func:`train` (``run_workers``); each rank
records at which step each attempt started in ``RUN_DIR/attempts/`` as fault_job.py does.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F
from fault_job import Samples, Tokens, gpt_loss, mlp

from meshtrain import Callback, Trainer


def gpt(dropout: float = 0.0, num_experts: int = 0) -> torch.nn.Module:
    """fault_job.py's tiny GPT, with dropout or as a mixture of experts."""
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=32, seq_len=8, num_layers=2, num_heads=2, d_model=16,
                         dropout=dropout, bias=False, num_experts=num_experts), seed=0)


MODELS = {"mlp": (mlp, Samples, F.mse_loss), "gpt": (gpt, Tokens, gpt_loss),
          "moe": (functools.partial(gpt, num_experts=4), Tokens, gpt_loss)}


class Attempts(Callback):
    """``RUN_DIR/attempts/rank{r}_attempt{a}``: the step each attempt of each rank started at."""

    def on_fit_start(self, trainer):
        folder = trainer.run_dir / "attempts"
        folder.mkdir(parents=True, exist_ok=True)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        (folder / f"rank{trainer.rank}_attempt{attempt}").write_text(str(trainer.global_step))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--root-dir", default="runs")
    p.add_argument("--name", default="points")
    p.add_argument("--layout", default=None)
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--async-ckpt", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)  # (the GPT's)
    p.add_argument("--sdc", type=int, default=None)
    p.add_argument("--nan-policy", default="error")
    p.add_argument("--stall-timeout", type=float, default=None)
    p.add_argument("--collective-timeout", type=float, default=300.0)
    return p


def train(argv: list[str]) -> dict:
    """Run the job; returns rank-local results."""
    args = parser().parse_args(argv)
    build, data, loss_fn = MODELS[args.model]
    if args.dropout:
        build = functools.partial(build, dropout=args.dropout)
    policy = None if args.nan_policy == "none" else args.nan_policy
    trainer = Trainer(
        layout=args.layout, devices="auto", accelerator="cpu", max_steps=args.max_steps,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        run_dir=args.run_dir, root_dir=args.root_dir, name=args.name, loggers=("csv",),
        log_every_n_steps=1, progress_bar=False, report=False, model_summary=False,
        checkpoint_every_n_steps=args.ckpt_every, async_checkpoint=args.async_ckpt,
        sdc_check_every_n_steps=args.sdc, nan_policy=policy,
        stall_timeout_s=args.stall_timeout, collective_timeout_s=args.collective_timeout,
        callbacks=[Attempts()], seed=0)
    trainer.fit(build, data(), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                loss_fn=loss_fn)
    return {"global_step": trainer.global_step, "skipped": trainer.num_skipped_steps,
            "rollbacks": trainer.num_rollbacks, "run_dir": str(trainer.run_dir)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    train(sys.argv[1:])
