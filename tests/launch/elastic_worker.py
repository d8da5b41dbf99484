"""A job for `meshtrain run --max-restarts K`: on attempt 0, rank 1 kills itself with SIGKILL.

    meshtrain run --nproc-per-node 2 --max-restarts 1 tests/launch/elastic_worker.py OUT_DIR

Every rank runs a few all_reduces whose sums it checks (a wrong sum raises, so the worker exits
1), and writes OUT_DIR/attempt{A}_rank{R}.json: the restart count it saw, the sums, times (process
start, group formed, SIGKILL on attempt 0) and whether it finished. On attempt 0 rank 1 SIGKILLs
itself after --kill-after all_reduces; rank 0 then goes on with its next all_reduce (it fails on
the lost peer; ``--survivor collective``) or sleeps until torchrun stops it (``--survivor sleep``,
so that rank 1 is surely the first failure torchrun sees). ``--plain`` creates the group with
plain ``dist.init_process_group("gloo")`` (env://) instead of meshtrain's, for comparison.
"""

import time

STARTED = time.time()  # before torch is imported: when this worker process started

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshtrain.launch.spawn import DistEnv, init_process_group, restart_count  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--survivor", choices=("collective", "sleep"), default="collective")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()

    attempt = restart_count()
    env = DistEnv.from_environ()
    timeout = timedelta(seconds=args.timeout)
    if args.plain:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        init_process_group(env, "gloo", timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {
        "attempt": attempt,
        "env_restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "started": STARTED,
        "group_formed": time.time(),
        "sums": [],
        "done": False,
    }
    marker = args.out / f"attempt{attempt}_rank{rank}.json"

    def save() -> None:
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, marker)

    save()
    for step in range(args.steps):
        if attempt == 0 and step == args.kill_after:
            if rank == 1:
                record["killed"] = time.time()
                save()
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.survivor == "sleep":
                time.sleep(300)  # torchrun stops this rank once rank 1's death is seen
        value = torch.tensor([float((rank + 1) * (step + 1) + 100 * attempt)])
        dist.all_reduce(value)
        expected = sum((r + 1) * (step + 1) for r in range(world)) + 100 * attempt * world
        if value.item() != expected:
            raise RuntimeError(f"rank {rank} step {step}: all_reduce gave {value.item()}, "
                               f"expected {expected}")
        record["sums"].append(value.item())
    record["done"] = True
    record["finished"] = time.time()
    save()
    sys.stdout.flush()
    if args.plain:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
