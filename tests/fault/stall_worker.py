"""One rank of a 2-rank job whose rank 1 stalls in step 3 (started by test_watchdog.py).

Usage: python stall_worker.py STACKS_DIR LIMIT_S, with RANK/WORLD_SIZE/MESHTRAIN_STORE set as
meshtrain.launch.spawn._worker_environ gives them. Rank 0 then waits in an all_reduce.
"""

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.launch.spawn import DistEnv, init_process_group
from meshtrain.fault.watchdog import StallWatchdog


def sleep_inside_step() -> None:
    time.sleep(60)


def train_step(step: int, rank: int) -> None:
    if rank == 1 and step == 3:
        sleep_inside_step()
    dist.all_reduce(torch.ones(4))


def main() -> None:
    stacks_dir, limit_s = Path(sys.argv[1]), float(sys.argv[2])
    torch.set_num_threads(1)
    env = DistEnv.from_environ()
    init_process_group(env, "gloo", timedelta(seconds=120))  # longer than the test: no gloo timeout
    watchdog = StallWatchdog(limit_s, stacks_dir, env.rank, env.world_size)
    watchdog.start()
    for step in range(1, 6):
        watchdog.arm(step)
        train_step(step, env.rank)
        watchdog.disarm()
    watchdog.stop()
    print(f"rank {env.rank} finished without a stall", flush=True)


if __name__ == "__main__":
    main()
