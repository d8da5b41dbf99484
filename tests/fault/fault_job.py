"""A small training job with switches that inject faults; the fault-injection tests run it.

As a script (under ``meshtrain run`` or plain ``python``)::

    python fault_job.py --run-dir DIR --max-steps 8 --ckpt-every 2 --kill-at-step 5

or in-process through :func:`train` (with ``run_workers`` for several ranks). Every rank appends
what it trained on to ``DIR/samples/rank{r}_attempt{a}.jsonl`` (one line per step: the global
step and the dataset indices it fetched), and ``DIR/attempts/`` records at which step each
attempt of each rank started, so a test can check what a restart resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from meshtrain import Callback, Trainer

NUM_SAMPLES, IN_FEATURES = 96, 8


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Samples(Dataset):
    """Regression pairs; remembers which indices were fetched; ``nan_index`` gives a NaN input."""

    def __init__(self, nan_index: int | None = None):
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator)
        self.y = self.x @ torch.randn(IN_FEATURES, 2, generator=generator)
        self.nan_index, self.fetched = nan_index, []

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        self.fetched.append(int(index))
        x = self.x[index]
        if index == self.nan_index:
            x = x * float("nan")
        return x, self.y[index]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def tiny_gpt() -> torch.nn.Module:
    from meshtrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=2, num_heads=2, d_model=16,
                       dropout=0.0, bias=False)
    return GPT(config, seed=0)


class Tokens(Dataset):
    """(inputs, next-token targets) of a fixed random sequence, for the GPT."""

    def __init__(self, nan_index=None):
        generator = torch.Generator().manual_seed(99)
        self.data = torch.randint(0, 32, (NUM_SAMPLES, 9), generator=generator)
        self.fetched = []

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        self.fetched.append(int(index))
        return self.data[index, :-1], self.data[index, 1:]


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Faults(Callback):
    """Records samples per step; kills, stalls or desynchronises one rank when told to."""

    def __init__(self, args, dataset):
        self.args, self.dataset = args, dataset

    def on_fit_start(self, trainer):
        folder = trainer.run_dir / "attempts"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank()}_attempt{attempt()}").write_text(str(trainer.global_step))
        (trainer.run_dir / "samples").mkdir(exist_ok=True)
        self.dataset.fetched.clear()
        if self.args.defer_nan_check:  # what nan_policy="error" does on a GPU, here on the CPU
            trainer._guard.defer = True
        if self.args.save_loaded:  # the weights as loaded, before the first step
            trainer.save_checkpoint(trainer.run_dir / "checkpoints" / "loaded")

    def on_train_step_start(self, trainer):
        args, step = self.args, trainer.global_step + 1
        hit = step == args.fault_step and rank() == args.fault_rank and attempt() == 0
        if hit and args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and args.fault == "stall":
            time.sleep(600)  # a rank stuck inside a step
        if hit and args.fault == "stop":  # a frozen rank: it cannot run Python any more
            os.kill(os.getpid(), signal.SIGSTOP)
        if hit and args.fault == "signal":  # as `scancel --signal=USR1` or Slurm's --signal
            os.kill(os.getpid(), signal.SIGUSR1)
        if hit and args.fault == "desync":  # a collective the other ranks do not run
            import torch.distributed as dist

            dist.all_reduce(torch.ones(3))

    def on_train_step_end(self, trainer, metrics):
        line = {"step": trainer.global_step, "samples": list(self.dataset.fetched)}
        if "train/loss" in metrics:
            line["loss"] = metrics["train/loss"]
        self.dataset.fetched.clear()
        path = trainer.run_dir / "samples" / f"rank{rank()}_attempt{attempt()}.jsonl"
        with path.open("a") as file:
            file.write(json.dumps(line) + "\n")


def _kill_during_save(mode: str, step: int) -> None:
    """SIGKILL rank 1 of attempt 0 while it writes the checkpoint of ``step`` (before commit)."""
    import torch.distributed.checkpoint as dcp

    if rank() != 1 or attempt() != 0:
        return
    real_save, real_async = dcp.save, dcp.async_save

    def at_step(checkpoint_id) -> bool:
        return f"{step:08d}" in str(checkpoint_id)

    def save(state, *a, checkpoint_id=None, **kw):
        if at_step(checkpoint_id):  # the other rank is writing its part meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(state, *a, checkpoint_id=checkpoint_id, **kw)

    def async_save(state, *a, checkpoint_id=None, **kw):
        result = real_async(state, *a, checkpoint_id=checkpoint_id, **kw)
        if at_step(checkpoint_id):  # dies while the background write may still be running
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL)).start()
            time.sleep(5)
        return result

    dcp.save, dcp.async_save = save, async_save


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--layout", default=None)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--async-ckpt", action="store_true")
    p.add_argument("--resume", default="auto")
    p.add_argument("--nan-index", type=int, default=None)
    p.add_argument("--nan-policy", default="error")
    p.add_argument("--defer-nan-check", action="store_true")
    p.add_argument("--fault", choices=("kill", "stall", "stop", "desync", "kill-in-save",
                                       "signal"),
                   default=None)
    p.add_argument("--stop-on-signal", default="auto")
    p.add_argument("--fault-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--stall-timeout", type=float, default=None)
    p.add_argument("--collective-timeout", type=float, default=300.0)
    p.add_argument("--init-timeout", type=float, default=600.0)
    p.add_argument("--debug-collectives", action="store_true")
    p.add_argument("--save-final", type=int, default=1)
    p.add_argument("--save-loaded", action="store_true")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    return p


def train(argv: list[str]) -> dict:
    """Run the job; returns rank-local results (final step, skipped steps)."""
    args = parser().parse_args(argv)
    if args.fault == "kill-in-save":
        _kill_during_save("async" if args.async_ckpt else "sync", args.fault_step)
    gpt = args.model == "gpt"
    dataset = Tokens() if gpt else Samples(args.nan_index)
    resume = None if args.resume == "none" else args.resume
    trainer = Trainer(
        layout=args.layout, devices="auto", accelerator=args.accelerator, max_steps=args.max_steps,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        run_dir=args.run_dir, loggers=("csv",), log_every_n_steps=1, progress_bar=False,
        checkpoint_every_n_steps=args.ckpt_every, async_checkpoint=args.async_ckpt,
        resume=resume, nan_policy=None if args.nan_policy == "none" else args.nan_policy,
        stall_timeout_s=args.stall_timeout, collective_timeout_s=args.collective_timeout,
        init_timeout_s=args.init_timeout,
        debug_collectives=args.debug_collectives, save_final_checkpoint=bool(args.save_final),
        callbacks=[Faults(args, dataset)], seed=0,
        stop_on_signal=None if args.stop_on_signal == "none" else args.stop_on_signal,
    )
    trainer.fit(tiny_gpt if gpt else mlp, dataset,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                loss_fn=gpt_loss if gpt else F.mse_loss)
    return {"global_step": trainer.global_step, "skipped": trainer.num_skipped_steps,
            "rollbacks": trainer.num_rollbacks, "stop_reason": trainer.stop_reason}


if __name__ == "__main__":
    torch.set_num_threads(1)
    train(sys.argv[1:])
