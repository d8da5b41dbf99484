"""A Trainer job for several `meshtrain run` agents on this machine, one "node" each
(tests/launch/test_multinode.py):

    meshtrain run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID tests/launch/multinode_job.py OUT \
        --layout dp=2 --steps 6

The model, data and optimizer are the resume matrix's (tests/checkpoint/resume_matrix_lib.py).
Every rank of every rendezvous round (a start or restart of the workers) writes
OUT/round{N}_rank{R}.json: what the launcher told it about the nodes (GROUP_RANK,
GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE, the restart count), the layout it resolved, the step it
started at, each step's loss and the dataset indices it fetched, and whether the fit finished;
a fit that ends in an error writes the error. Rank 0 writes OUT/final_state.pt (the whole model
and optimizer state) at the end of the fit.

``--pause STEP:WORLD`` (repeatable): a fit on WORLD processes, after step STEP, writes
OUT/paused_s{STEP}_rank{R} on every rank and waits for OUT/go_s{STEP}, so that the test can
kill or add a node at a known point of the run.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import torch  # noqa: E402

from checkpoint.resume_matrix_lib import (  # noqa: E402
    GLOBAL_BATCH, IndexedTokens, full_state, lm_loss, model, optimizer)
from meshtrain import Callback, Trainer  # noqa: E402
from meshtrain.launch.spawn import DistEnv  # noqa: E402
from meshtrain.plan.auto import cluster_for  # noqa: E402

NODE_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "MESHTRAIN_RDZV_ROUND")


class Record(Callback):
    """Per step: the loss and the indices this rank fetched; the pause for the test."""

    def __init__(self, dataset, out: Path, pauses: list[str]):
        self.dataset, self.out = dataset, out
        self.pauses = {tuple(int(x) for x in p.split(":")) for p in pauses}
        self.record = {"env": {k: os.environ.get(k) for k in NODE_ENV},
                       "agent_pid": os.getppid(), "losses": {},
                       "fetched": {}, "done": False}

    def path(self, rank: int) -> Path:
        return self.out / f"round{os.environ['MESHTRAIN_RDZV_ROUND']}_rank{rank}.json"

    def on_fit_start(self, trainer):
        self.dataset.fetched.clear()  # the Trainer's look at a sample input
        self.record.update(layout=str(trainer.layout), world_size=trainer.world_size,
                           dp_rank=trainer.dp_rank, start_step=trainer.global_step)
        # the nodes as the launcher describes them, and as layout="auto"'s planner sees them
        env = DistEnv.from_environ()
        cluster = cluster_for({"plan_cluster": "8xH100", "precision": "fp32"},
                              trainer.world_size, env.local_world_size, "cpu")
        self.record.update(nodes=env.nodes, planner_nodes=cluster.nodes,
                           planner_devices_per_node=cluster.devices_per_node)
        self.save(trainer.rank)

    def on_train_step_end(self, trainer, metrics):
        step = trainer.global_step
        self.record["losses"][step] = metrics["train/loss"]
        self.record["fetched"][step] = list(self.dataset.fetched)
        self.dataset.fetched.clear()
        self.save(trainer.rank)
        if (step, trainer.world_size) in self.pauses:
            (self.out / f"paused_s{step}_rank{trainer.rank}").touch()
            deadline = time.monotonic() + 120
            while not (self.out / f"go_s{step}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def save(self, rank: int) -> None:
        tmp = self.path(rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record))
        tmp.replace(self.path(rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", default="dp=auto")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--pause", action="append", default=[], metavar="STEP:WORLD")
    args = parser.parse_args()
    torch.set_num_threads(1)

    dataset = IndexedTokens()
    recorder = Record(dataset, args.out, args.pause)
    settings = dict(layout=args.layout, pp_schedule="1f1b") if "pp" in args.layout else \
        dict(layout=args.layout)
    rank = int(os.environ["RANK"])
    try:
        trainer = Trainer(**settings, max_steps=args.steps, global_batch_size=GLOBAL_BATCH, seed=0,
                          log_every_n_steps=1, loggers=(), progress_bar=False, report=False,
                          save_final_checkpoint=False, run_dir=str(args.out / "run"),
                          num_workers=0, accelerator="cpu",
                          checkpoint_every_n_steps=args.checkpoint_every,
                          resume="auto", callbacks=[recorder])
        trainer.fit(model, dataset, optimizer=optimizer, loss_fn=lm_loss)
    except BaseException as error:
        recorder.record["error"] = f"{type(error).__name__}: {error}"
        recorder.save(rank)
        raise
    state = full_state(trainer)
    recorder.record["done"] = True
    recorder.save(rank)
    if rank == 0:
        torch.save(state, args.out / "final_state.pt")


if __name__ == "__main__":
    main()
