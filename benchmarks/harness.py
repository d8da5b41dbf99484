"""What the benchmark scripts share: timing a measurement over N calls, interleaved repeats and
their min / median / max, paired ratios, random token data, the slower rank's figures, the start and end of a
worker process, result tables, and the machine and JSON that go to benchmarks/results/.

A script imports it as ``harness``: ``python benchmarks/NAME.py`` puts benchmarks/ on sys.path,
and the worker processes that ``run_workers`` starts inherit that path.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


# ---- data ---------------------------------------------------------------------------------------
def token_pairs(vocab: int, samples: int, seq_len: int, seed: int = 0):
    """``samples`` random token sequences as (inputs, the next tokens) pairs: a language
    model's training data where only the shapes matter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (samples, seq_len + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


# ---- measuring ----------------------------------------------------------------------------------
def mean_time(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of ``fn()`` over ``n`` calls in a row."""
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def median_time(fn: Callable[[], object], n: int = 25, skip: int = 5,
                before: Callable[[], object] | None = None) -> float:
    """Median seconds of one call of ``fn()`` over ``n`` calls, the first ``skip`` left out
    (warm-up); ``before()`` (e.g. a barrier) runs untimed ahead of each call."""
    times = []
    for _ in range(n):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[skip:])


def interleaved(names: Sequence[str], repeats: int, run: Callable[[str], dict],
                describe: Callable[[str, dict], str]) -> dict[str, list[dict]]:
    """``run(name)`` for every name, ``repeats`` rounds of all names (a, b, c, a, b, c, ...), so
    that load from other jobs on the machine hits every name alike; one progress line per run
    (``describe(name, result)``). Returns {name: [its result in each repeat]}."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names:
            started = time.perf_counter()
            runs[name].append(run(name))
            print(f"  repeat {rep + 1}/{repeats} {describe(name, runs[name][-1])} "
                  f"(run took {time.perf_counter() - started:.1f} s)", flush=True)
    return runs


# ---- repeats ------------------------------------------------------------------------------------
def spread(values: Iterable[float], scale: float = 1.0, suffix: str = "") -> dict[str, float]:
    """{"median", "min", "max"} (each name + ``suffix``) of repeated measurements, x ``scale``."""
    values = [scale * v for v in values]
    return {f"median{suffix}": statistics.median(values), f"min{suffix}": min(values),
            f"max{suffix}": max(values)}


def in_ms(seconds: Sequence[float]) -> dict:
    """Repeated times in seconds as {"median_ms": ..., "repeats_ms": [...]}."""
    return {"median_ms": 1e3 * statistics.median(seconds), "repeats_ms": [1e3 * t for t in seconds]}


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of the per-repeat ratios ``values[i] / baseline[i]``: each repeat ran next to
    its baseline run, so slow drift of the machine's load cancels out."""
    return statistics.median([v / b for v, b in zip(values, baseline)])


def add_ratios(summary: dict[str, dict], baseline: str, ratios: dict[str, str]) -> None:
    """Give every row of ``summary`` its ratios to the row ``baseline``: ``ratios`` maps each new
    key to the field divided, "repeats_ms" meaning the paired ratio; None where no baseline ran."""
    base = summary.get(baseline)
    for row in summary.values():
        for key, field in ratios.items():
            if base is None:
                row[key] = None
            elif field == "repeats_ms":
                row[key] = paired_ratio(row[field], base[field])
            else:
                row[key] = row[field] / base[field]


def slower_rank(ranks: list[dict], key: str) -> dict[str, list[float]]:
    """{case: [per repeat, the largest ``rank[key][case][repeat]`` over the ranks]}: a job's
    step takes as long as its slower rank. A case that ran on some ranks only (a one-process
    baseline on rank 0) is taken from those; rank 0 must have run every case."""
    return {name: [max(r[key][name][i] for r in ranks if name in r[key])
                   for i in range(len(runs))]
            for name, runs in ranks[0][key].items()}


# ---- a worker started by run_workers ------------------------------------------------------------
@contextlib.contextmanager
def hang_guard(seconds: float):
    """Print every thread's stack to stderr if the body runs past ``seconds``: a rank that hangs
    shows where before ``run_workers`` kills it."""
    faulthandler.dump_traceback_later(seconds, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def init_gloo(timeout_s: float) -> int:
    """Join the worker's job in a gloo process group (``timeout_s`` per collective); its rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.launch.spawn import DistEnv, init_process_group

    init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds=timeout_s))
    return dist.get_rank()


def lightning_as_torchrun_worker(run_id: str):
    """Make this run_workers rank look like a torchrun worker, so that Lightning picks
    TorchElasticEnvironment: it then starts no processes of its own, reads RANK/WORLD_SIZE/
    LOCAL_RANK, and (as under torchrun) every rank joins the store that run_workers' launching
    process hosts at MASTER_ADDR:MASTER_PORT. Lightning's warnings (e.g. "the DataLoader does not
    have many workers"), banners and tips are silenced. Returns the ``lightning`` module."""
    import logging
    import warnings

    os.environ.update(TORCHELASTIC_RUN_ID=run_id, GROUP_RANK="0",
                      ROLE_RANK=os.environ["RANK"], TORCHELASTIC_USE_AGENT_STORE="True")
    warnings.filterwarnings("ignore")
    import lightning

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return lightning


def drain_collectives() -> None:
    """Let the gloo worker threads retire their finished work before the process group dies.

    Work launched during backward carries the autograd thread-local state, including a Python
    object (``torch.autograd.graph._engine_run_backward`` stashes a ``contextvars`` context), so
    the gloo thread that retires it must take the GIL. If the last reference to the DDP reducer
    (hence to the ``ProcessGroupGloo``) is dropped at that moment, the destructor joins that
    thread while holding the GIL and both wait forever (seen with torch 2.13: roughly one run
    in ten hung at teardown, in every variant). A barrier waits for all earlier work; the sleep
    releases the GIL so the gloo threads can finish retiring it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)


def end_process_group() -> None:
    """``drain_collectives``, then destroy the process group; call it while the models and
    optimizers whose work went through the group are still alive."""
    import torch.distributed as dist

    if not dist.is_initialized():  # a one-process run made none
        return
    drain_collectives()
    dist.destroy_process_group()


# ---- results ------------------------------------------------------------------------------------
def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "-" where there is none (a ratio without a baseline)."""
    return "-" if value is None else format(value, spec)


def table(header: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 1) -> str:
    """Rows of strings in aligned columns under ``header`` and a rule of dashes: the first
    ``left`` columns flush left (names), the others flush right (numbers). Printed as it is, and
    pasted into benchmarks/README.md's code blocks."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def render(cells) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([render(lines[0]), "  ".join("-" * w for w in widths),
                      *(render(line) for line in lines[1:])])


class WallClock:
    """A whole benchmark run's wall time and the machine's load average before and after it
    (other jobs on the machine show in the times)."""

    def __init__(self):
        self.started, self.load_before = time.perf_counter(), os.getloadavg()
        self.wall_s, self.load_after = None, None

    def stop(self) -> str:
        self.wall_s = time.perf_counter() - self.started
        self.load_after = os.getloadavg()
        return (f"ran in {self.wall_s:.0f} s, load average {self.load_before[0]:.1f} before, "
                f"{self.load_after[0]:.1f} after")

    def loads(self) -> dict:
        return {"load_average_before": self.load_before, "load_average_after": self.load_after}


def machine(**extra) -> dict:
    """What the results were measured on, for the JSON; ``extra`` adds to it."""
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, **extra}


def write_json(path, result: dict, *, indent: int = 1) -> Path:
    """Write ``result`` to ``path`` (its folder created if need be); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent))
    return path
