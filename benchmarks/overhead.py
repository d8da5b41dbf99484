"""Framework overhead: meshtrain (and optionally Lightning) against a hand-written DDP loop.

Every variant trains the same MLP classifier on the same synthetic data with AdamW and the same
global batch, on 2 processes (gloo, CPU, one torch thread per rank):

* ``raw``: the plain torchrun-style loop: a process group, ``DDP(model)``, a ``DataLoader``
  over a ``DistributedSampler``, and per batch zero_grad / forward + cross-entropy / backward /
  step. This is the floor: what any framework adds shows up as time above it.
* ``meshtrain``: ``meshtrain.Trainer(layout="dp=2", ...)`` fit on the same data, with loggers,
  progress bar and final checkpoint off.
* ``lightning``: ``lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")`` with
  progress bar, logger, checkpointing and model summary off (skipped when ``lightning`` is not
  installed: ``pip install -e '.[bench]'``).

Each variant runs on fresh processes from ``meshtrain.launch.spawn.run_workers``. Start-up is
not timed: every rank takes a timestamp at the end of each optimizer step, and the step time is
(end of the last step - end of the last warm-up step) / timed steps, so it includes everything
a framework does between two steps (data loading, hooks, logging). Repeats are interleaved
(raw, meshtrain, lightning, raw, ...) so that machine noise hits all variants alike. The table
shows, per variant, the median over repeats of the wall-clock step time, its ratio to raw
(``x raw``), the median of the per-repeat ratios to the raw run just before (``paired``), and
the CPU time per step of a rank (all its threads), which other jobs on the machine disturb much
less than wall-clock time.

    python benchmarks/overhead.py                   # 20 warm-up + 200 timed steps, 5 repeats
    python benchmarks/overhead.py --quick           # smoke run (one short run of each variant)
    python benchmarks/overhead.py --raw-bucket-view # raw DDP with meshtrain's DDP setting
    python benchmarks/overhead.py --variants raw,meshtrain,meshtrain-global-mean
    python benchmarks/overhead.py --variants raw,meshtrain,meshtrain-unmeasured  # measurements
    python benchmarks/overhead.py --out overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from harness import (
    add_ratios, drain_collectives, end_process_group, fmt, hang_guard, interleaved,
    lightning_as_torchrun_worker, machine, spread, table, write_json,
)
from torch.utils.data import DataLoader, TensorDataset

from meshtrain.launch.spawn import run_workers

WORLD_SIZE = 2
# meshtrain-global-mean: meshtrain with loss_fn=meshtrain.losses.cross_entropy() (the items of
# the step counted over the ranks: one more all-reduce of a number per step)
# meshtrain-unmeasured: meshtrain without its default measurements (breakdown_every_n_steps
# None, and with it the straggler check): what the step-time breakdown costs
VARIANTS = ("raw", "meshtrain", "meshtrain-global-mean", "meshtrain-unmeasured", "lightning")
DEFAULT_VARIANTS = ("raw", "meshtrain", "lightning")


@dataclass(frozen=True)
class Config:
    """What every variant trains; one global batch per optimizer step."""

    steps: int = 200  # timed optimizer steps
    warmup: int = 20  # untimed steps before them
    global_batch_size: int = 128  # 64 samples per rank
    in_features: int = 256
    hidden: int = 768
    num_classes: int = 10
    lr: float = 1e-3
    seed: int = 0
    # meshtrain wraps with DDP(gradient_as_bucket_view=True); the plain loop uses DDP's default
    # (False) unless --raw-bucket-view asks for the same setting (framework cost alone).
    raw_bucket_view: bool = False
    # meshtrain's per-step NaN/Inf check (one small all-reduce and a pass over the gradients);
    # "none" turns it off to measure what it costs
    nan_policy: str = "error"

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch_size // WORLD_SIZE

    @property
    def num_samples(self) -> int:
        # One epoch covers the whole run: no variant pays for an epoch boundary in the window.
        return self.global_batch_size * self.total_steps


def build_model(cfg: Config) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(cfg.in_features, cfg.hidden), torch.nn.GELU(),
        torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.GELU(),
        torch.nn.Linear(cfg.hidden, cfg.num_classes),
    )


def build_data(cfg: Config) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(cfg.num_samples, cfg.in_features, generator=gen)
    y = torch.randint(0, cfg.num_classes, (cfg.num_samples,), generator=gen)
    return TensorDataset(x, y)


def make_optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


class StepClock:
    """Timestamps at optimizer-step boundaries; the timed window starts after the warm-up."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.ends: list[float] = []
        self.cpu: list[float] = []

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())
        # CPU time of all this rank's threads (gloo's included), only at the window's two ends:
        # reading it costs about a millisecond here, far more than perf_counter.
        if len(self.ends) in (self.warmup, self.warmup + self.steps):
            self.cpu.append(time.process_time())

    def result(self, variant: str) -> dict:
        need = self.warmup + self.steps
        if len(self.ends) != need:
            raise RuntimeError(f"{variant}: saw {len(self.ends)} step ends, expected {need}")
        window = self.ends[self.warmup - 1 :]  # from the end of the last warm-up step
        deltas = [b - a for a, b in zip(window, window[1:])]
        return {
            "variant": variant,
            "rank": int(os.environ.get("RANK", 0)),
            "mean_step_s": (window[-1] - window[0]) / self.steps,
            "median_step_s": statistics.median(deltas),
            # the slowest timed step (1-based step number, seconds): a one-off shows here
            "slowest_step": max(((self.warmup + 1 + i, d) for i, d in enumerate(deltas)),
                                key=lambda pair: pair[1]),
            "cpu_step_s": (self.cpu[1] - self.cpu[0]) / self.steps,
        }


# ---------------------------------------------------------------------------------------------
# (a) the hand-written loop
# ---------------------------------------------------------------------------------------------
def raw_worker(cfg: Config) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    # run_workers gives RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like torchrun; like torchrun's
    # workers, we join the store the launcher hosts instead of hosting one on rank 0.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    dist.init_process_group("gloo")
    torch.manual_seed(cfg.seed)
    model = DDP(build_model(cfg), gradient_as_bucket_view=cfg.raw_bucket_view)
    optimizer = make_optimizer(model.parameters(), cfg.lr)
    dataset = build_data(cfg)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.per_rank_batch, sampler=sampler, drop_last=True)

    clock = StepClock(cfg.warmup, cfg.steps)
    step, epoch = 0, 0
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            step += 1
            clock.step_end()
            if step == cfg.total_steps:
                break
        epoch += 1
    result = clock.result("raw")
    end_process_group()
    return result


# ---------------------------------------------------------------------------------------------
# (b) meshtrain
# ---------------------------------------------------------------------------------------------
def meshtrain_worker(cfg: Config, log_every_n_steps: int, global_mean: bool = False,
                     measured: bool = True) -> dict:
    from meshtrain import Trainer, losses
    from meshtrain.callbacks import Callback

    class Clock(Callback):
        def __init__(self, clock: StepClock):
            self.clock = clock

        def on_train_step_end(self, trainer, metrics: dict) -> None:
            self.clock.step_end()

    clock = StepClock(cfg.warmup, cfg.steps)
    quiet = contextlib.redirect_stdout(io.StringIO())  # e.g. the model-state table after step 1
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as run_dir, quiet:
        trainer = Trainer(
            layout=f"dp={WORLD_SIZE}", accelerator="cpu", max_steps=cfg.total_steps,
            global_batch_size=cfg.global_batch_size, seed=cfg.seed, shuffle=True,
            callbacks=[Clock(clock)], loggers=(), progress_bar=False,
            save_final_checkpoint=False, log_every_n_steps=log_every_n_steps, run_dir=run_dir,
            nan_policy=None if cfg.nan_policy == "none" else cfg.nan_policy, resume=None,
            **({} if measured else {"breakdown_every_n_steps": None}),  # (no straggler check)
        )
        trainer.fit(
            lambda: build_model(cfg), build_data(cfg),
            optimizer=lambda params: make_optimizer(params, cfg.lr),
            loss_fn=losses.cross_entropy() if global_mean else F.cross_entropy,
        )
        end_process_group()  # while the trainer (and its DDP wrapper) is still alive
    return clock.result("meshtrain-global-mean" if global_mean else (
        "meshtrain" if measured else "meshtrain-unmeasured"))


# ---------------------------------------------------------------------------------------------
# (c) Lightning
# ---------------------------------------------------------------------------------------------
def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def lightning_worker(cfg: Config) -> dict:
    L = lightning_as_torchrun_worker("meshtrain-overhead-bench")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(cfg.seed)
            self.net = build_model(cfg)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return F.cross_entropy(self.net(inputs), targets)

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), cfg.lr)

    class Clock(L.Callback):
        def __init__(self, clock: StepClock):
            self.clock = clock

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.clock.step_end()

    clock = StepClock(cfg.warmup, cfg.steps)
    # shuffle=True: Lightning swaps in a DistributedSampler(shuffle=True) itself.
    loader = DataLoader(build_data(cfg), batch_size=cfg.per_rank_batch, shuffle=True,
                        drop_last=True)
    with tempfile.TemporaryDirectory(prefix="lightning-bench-") as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=cfg.total_steps,
            enable_progress_bar=False, logger=False, enable_checkpointing=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Clock(clock)],
            default_root_dir=root,
        )
        trainer.fit(Module(), loader)
        drain_collectives()
    return clock.result("lightning")


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def bench_worker(variant: str, cfg: Config, log_every_n_steps: int, hang_s: float) -> dict:
    """One rank of one run; if it hangs, its stack goes to stderr before it is killed."""
    with hang_guard(hang_s):
        if variant == "raw":
            return raw_worker(cfg)
        if variant.startswith("meshtrain"):
            return meshtrain_worker(cfg, log_every_n_steps, variant == "meshtrain-global-mean",
                                    variant != "meshtrain-unmeasured")
        return lightning_worker(cfg)


def run_variant(variant: str, cfg: Config, log_every_n_steps: int, timeout: float) -> dict:
    args = (variant, cfg, log_every_n_steps, max(1.0, timeout - 10))
    ranks = run_workers(bench_worker, WORLD_SIZE, args, timeout=timeout, threads=1)
    # Ranks step together (every step all-reduces); the slower rank's clock is the job's.
    return {
        key: max(r[key] for r in ranks)
        for key in ("mean_step_s", "median_step_s", "cpu_step_s")
    } | {"slowest_step": max((r["slowest_step"] for r in ranks), key=lambda pair: pair[1]),
         "ranks": ranks}


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for variant, reps in runs.items():
        means = [r["mean_step_s"] for r in reps]
        cpu = [r["cpu_step_s"] for r in reps]
        summary[variant] = {
            **spread(means, scale=1e3, suffix="_ms"),
            "repeats_ms": [1e3 * m for m in means],
            "cpu_median_ms": 1e3 * statistics.median(cpu),
        }
    # Paired by repeat (each ran right next to a raw run): less sensitive to slow drift.
    add_ratios(summary, "raw", {"ratio_vs_raw": "median_ms", "paired_ratio_median": "repeats_ms",
                                "cpu_ratio_vs_raw": "cpu_median_ms"})
    return summary


def format_table(summary: dict[str, dict]) -> str:
    header = ("variant", "median ms/step", "min", "max", "x raw", "paired", "cpu ms/step",
              "cpu x raw")
    return table(header, [(
        variant, f"{row['median_ms']:.2f}", f"{row['min_ms']:.2f}", f"{row['max_ms']:.2f}",
        fmt(row["ratio_vs_raw"], ".3f"), fmt(row["paired_ratio_median"], ".3f"),
        f"{row['cpu_median_ms']:.2f}", fmt(row["cpu_ratio_vs_raw"], ".3f"),
    ) for variant, row in summary.items()])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run (200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (20)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (5)")
    parser.add_argument("--log-every-n-steps", type=int, default=50,
                        help="meshtrain's log_every_n_steps (50)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--raw-bucket-view", action="store_true",
                        help="give the raw loop DDP(gradient_as_bucket_view=True) as meshtrain has")
    parser.add_argument("--nan-policy", default="error", choices=("error", "skip", "none"),
                        help="meshtrain's nan_policy (default error, the Trainer's default)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 warm-up + 10 timed steps, 1 repeat")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a hung run is killed")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 10, 3, 1
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # One torch thread per rank for every variant (meshtrain and Lightning would otherwise pick
    # cpu_count // local_world_size threads themselves).
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = Config(steps=args.steps, warmup=args.warmup, raw_bucket_view=args.raw_bucket_view,
                 nan_policy=args.nan_policy)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
        return 2
    if "lightning" in variants and not lightning_available():
        print("lightning: skipped (not installed; pip install -e '.[bench]')")
        variants.remove("lightning")

    print(f"overhead benchmark: {WORLD_SIZE} ranks (gloo, CPU, 1 thread each), "
          f"MLP {cfg.in_features}-{cfg.hidden}-{cfg.hidden}-{cfg.num_classes}, "
          f"global batch {cfg.global_batch_size}, AdamW, {cfg.warmup} warm-up + {cfg.steps} "
          f"timed steps, {args.repeats} repeats, torch {torch.__version__}; raw loop: DDP("
          f"gradient_as_bucket_view={cfg.raw_bucket_view})", flush=True)
    runs = interleaved(
        variants, args.repeats,
        lambda variant: run_variant(variant, cfg, args.log_every_n_steps, args.timeout),
        lambda variant, res: (f"{variant:<10} {1e3 * res['mean_step_s']:8.3f} ms/step, median "
                              f"single step {1e3 * res['median_step_s']:.3f} ms, slowest "
                              f"step {res['slowest_step'][0]}: "
                              f"{1e3 * res['slowest_step'][1]:.1f} ms, cpu "
                              f"{1e3 * res['cpu_step_s']:.3f} ms/step"))

    summary = summarize(runs)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print()
    print(format_table(summary))
    if "meshtrain" in runs and "meshtrain-unmeasured" in runs:  # paired, repeat by repeat
        pairs = list(zip(runs["meshtrain"], runs["meshtrain-unmeasured"]))
        ratios = [a["mean_step_s"] / b["mean_step_s"] for a, b in pairs]
        cpu = [a["cpu_step_s"] / b["cpu_step_s"] for a, b in pairs]
        summary["measurement_cost_paired"] = statistics.median(ratios)
        summary["measurement_cost_cpu_paired"] = statistics.median(cpu)
        print(f"the default measurements (step-time breakdown, straggler check): meshtrain / "
              f"meshtrain-unmeasured = {statistics.median(ratios):.4f} paired, cpu "
              f"{statistics.median(cpu):.4f} (repeats: {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"cpu {', '.join(f'{r:.3f}' for r in cpu)})")
    if load is not None:
        # Other jobs on the machine show up in the wall-clock columns (not much in cpu ms/step).
        print(f"load average at the end (1/5/15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
              f"on {os.cpu_count()} CPUs")
    if args.out:
        payload = {
            "config": asdict(cfg) | {"world_size": WORLD_SIZE, "backend": "gloo",
                                     "threads_per_rank": 1, "repeats": args.repeats,
                                     "log_every_n_steps": args.log_every_n_steps},
            "machine": machine(load_average_at_end=load),
            "summary": summary,
            "runs": runs,
        }
        if "lightning" in variants:
            import lightning

            payload["machine"]["lightning"] = lightning.__version__
        print(f"\nwrote {write_json(args.out, payload, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
