"""Parameter servers against all-reduce (issue 15, item 3): step time and bytes moved per step
against the number of workers W, and the loss curves of the same task.

Variants, all through ``Trainer(layout=...)`` (gloo / TensorPipe, CPU, one torch thread per
process, ``OMP_NUM_THREADS=1``):

* ``dp``: DDP all-reduce, ``layout="dp=W"`` (W processes; W = 1 is one process, no layout);
* ``ps1`` / ``ps2``: synchronous parameter servers, ``layout="ps=S,dp=W"`` (S + W processes:
  the workers push their gradients over ``torch.distributed.rpc`` and copy back the servers'
  parameters; the servers hold the parameters and run AdamW);
* ``async``: ``ps=1`` with ``ps_mode="async", ps_staleness=1`` (each push applied on arrival);
* ``local4`` / ``local16``: local SGD, ``layout="dp=W", local_sgd_every=H`` (parameters averaged
  every H steps, no gradient all-reduce; W = 1 would be the one-process run, so it is not run).

Every variant trains the same MLP of ``depth`` equal ``Linear(width, width)`` layers (GELU
between them; 4.2M parameters, 16 MiB in fp32 at 4 x 1024) with AdamW on a teacher regression
task (y = tanh(x U V) + noise, U V of rank 64), ``batch`` samples per worker and step.

Step time: rank 0 (worker 0) stamps every ``on_train_step_end``; the step time is the median of
the gaps over the timed steps (after ``warmup`` untimed steps). One fresh set of processes per
run (``run_workers``); the runs go W by W (all variants at W = 1, then W = 2, ...), so that a
change of the machine's load hits the variants of one W alike.

Bytes per worker per step:

* ps: what ``PSClient`` counts (``bytes_sent`` / steps: the gradients pushed; ``bytes_per_step``:
  pushed + parameters received), and what the servers count (``server_stats()``: the busiest
  server's ``bytes_received`` / steps, taken after the last step once every worker is done);
  predicted: worker sends P and receives P, one server receives W x P, each of two W x P / 2
  (P = parameter bytes);
* dp: DDP counts nothing; the ring all-reduce figure 2(W-1)/W x P sent (and as much received)
  per worker per step;
* local SGD: ``LocalSGD.bytes_per_step`` (the payload all-reduced, P / H, averaged over steps)
  and the ring figure 2(W-1)/W x P / H sent per worker.

Loss curves: the same task at W = ``--curve-workers`` for ``--curve-steps`` steps, the logged
training loss of every step (the workers' mean) for dp, ps1 (sync), async, local4 and local16,
and the loss of the final model on the whole data set.

    python benchmarks/parameter_server.py                 # W = 1 2 3 4; ~4 min on 2 cores
    python benchmarks/parameter_server.py --quick         # smoke run (W = 1 2, few steps)
    python benchmarks/parameter_server.py --workers 1 2 4 8 12 --curve-workers 4   # more cores
    python benchmarks/parameter_server.py --from-json benchmarks/results/parameter_server.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import WallClock, fmt, hang_guard, machine, table, write_json
from torch.utils.data import TensorDataset

from meshtrain.launch.spawn import run_workers

VARIANTS = ("dp", "ps1", "ps2", "async", "local4", "local16")
CURVE_VARIANTS = ("dp", "ps1", "async", "local4", "local16")
LABELS = {"dp": "dp (all-reduce)", "ps1": "ps=1 sync", "ps2": "ps=2 sync",
          "async": "ps=1 async, s=1", "local4": "local SGD H=4", "local16": "local SGD H=16"}
MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Config:
    width: int = 1024
    depth: int = 4  # Linear(width, width) layers: 4.2M parameters at 4 x 1024
    batch: int = 32  # samples per worker and step
    warmup: int = 5  # untimed steps
    steps: int = 25  # timed steps
    lr: float = 1e-3
    data_size: int = 4096  # samples of the regression task (epochs repeat them)
    seed: int = 0

    @property
    def num_params(self) -> int:
        return self.depth * (self.width * self.width + self.width)

    @property
    def param_bytes(self) -> int:
        return 4 * self.num_params


def build_model(cfg: Config) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i in range(cfg.depth):
        layers.append(torch.nn.Linear(cfg.width, cfg.width))
        if i < cfg.depth - 1:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def build_data(cfg: Config, rank: int = 64) -> TensorDataset:
    """y = tanh(x U V) + 0.1 noise, x ~ N(0, I), U V a random rank-64 map with unit gain:
    learnable by the MLP, and cheap to build in every process."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(cfg.data_size, cfg.width, generator=gen)
    u = torch.randn(cfg.width, rank, generator=gen) / math.sqrt(cfg.width)
    v = torch.randn(rank, cfg.width, generator=gen) / math.sqrt(rank)
    y = torch.tanh(x @ u @ v) + 0.1 * torch.randn(cfg.data_size, cfg.width, generator=gen)
    return TensorDataset(x, y)


def trainer_settings(variant: str, workers: int) -> tuple[dict, int]:
    """(Trainer layout settings, number of processes) of ``variant`` on ``workers`` workers."""
    if variant == "dp" or variant.startswith("local"):
        settings = {"layout": f"dp={workers}"} if workers > 1 else {"layout": None}
        if variant.startswith("local"):
            settings["local_sgd_every"] = int(variant[len("local"):])
        return {**settings, "devices": workers}, workers
    servers = 2 if variant == "ps2" else 1
    settings = {"layout": f"ps={servers},dp={workers}", "devices": servers + workers}
    if variant == "async":
        settings.update(ps_mode="async", ps_staleness=1)
    return settings, servers + workers


# -------------------------------------------------------------------------------------------------
# one run (on every process)
# -------------------------------------------------------------------------------------------------
def run_rank(variant: str, workers: int, cfg: Config, total_steps: int, log_every: int,
             hang_s: float) -> dict:
    """Train; on worker 0 return the step-end stamps, losses, byte counters and final loss."""
    import torch.distributed as dist

    from meshtrain import Trainer
    from meshtrain.callbacks import Callback

    torch.set_num_threads(1)

    class Probe(Callback):
        def __init__(self):
            self.ends, self.cpu, self.losses = [], [], []
            self.counted: dict = {}

        def on_train_step_end(self, trainer, metrics):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            if "train/loss" in metrics:
                self.losses.append(float(metrics["train/loss"]))
            if trainer.global_step == total_steps:
                self.counters(trainer)

        def counters(self, trainer):
            """After the last step, before the end of training closes the RPC world."""
            client = getattr(trainer.optimizer, "client", None)
            averager = trainer.engine.averager
            if client is not None:
                if dist.is_initialized():
                    dist.barrier()  # every worker has pushed its last gradients
                self.counted = {
                    "client_bytes_per_step": client.bytes_per_step,
                    "client_bytes_sent": client.bytes_sent,
                    "client_bytes_received": client.bytes_received,
                    "client_steps": client.step_count,
                    "servers": client.server_stats() if client.worker == 0 else None,
                }
            elif averager is not None and hasattr(averager, "param_bytes"):
                self.counted = {"local_sgd_bytes_per_step": averager.bytes_per_step,
                                "local_sgd_param_bytes": averager.param_bytes}

    settings, _ = trainer_settings(variant, workers)
    probe = Probe()
    with hang_guard(hang_s), tempfile.TemporaryDirectory(prefix="meshtrain-ps-bench-") as run_dir:
        trainer = Trainer(
            **settings, accelerator="cpu", max_steps=total_steps,
            global_batch_size=cfg.batch * workers, seed=cfg.seed, callbacks=[probe],
            loggers=(), progress_bar=False, save_final_checkpoint=False,
            log_every_n_steps=log_every, run_dir=run_dir)
        data = build_data(cfg)
        model = trainer.fit(lambda: build_model(cfg), data,
                            optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
                            loss_fn=F.mse_loss)
        rank = int(os.environ.get("RANK", "0"))
        final_loss = None
        if rank == 0:  # the trained model (ps: fetched from the servers; local SGD: averaged)
            with torch.no_grad():
                final_loss = float(F.mse_loss(model(data.tensors[0]), data.tensors[1]))
        if dist.is_initialized():  # workers (the servers join no process group)
            dist.barrier()
            time.sleep(0.05)  # harness.drain_collectives: gloo threads retire their work
            dist.destroy_process_group()
    if rank != 0:
        return {"rank": rank}
    return {"rank": rank, "ends": probe.ends, "cpu": probe.cpu, "losses": probe.losses,
            "final_loss": final_loss, **probe.counted}


def run(variant: str, workers: int, cfg: Config, total_steps: int, log_every: int,
        timeout: float) -> dict:
    _, procs = trainer_settings(variant, workers)
    started = time.perf_counter()
    ranks = run_workers(run_rank, procs,
                        (variant, workers, cfg, total_steps, log_every, max(1.0, timeout - 10)),
                        timeout=timeout, threads=1)
    out = ranks[0]
    out["procs"], out["run_s"] = procs, time.perf_counter() - started
    return out


# -------------------------------------------------------------------------------------------------
# the scaling table
# -------------------------------------------------------------------------------------------------
def scaling_row(variant: str, workers: int, cfg: Config, out: dict) -> dict:
    P, ends = cfg.param_bytes, out["ends"]
    gaps = [b - a for a, b in zip(ends[cfg.warmup - 1:], ends[cfg.warmup:])]
    cpu = out["cpu"]
    row = {
        "variant": variant, "workers": workers, "procs": out["procs"],
        "step_ms": 1e3 * statistics.median(gaps), "step_ms_mean": 1e3 * statistics.mean(gaps),
        "cpu_ms_worker0": 1e3 * (cpu[-1] - cpu[cfg.warmup - 1]) / len(gaps),
        "run_s": out["run_s"], "final_loss": out["final_loss"],
        "worker_sent": None, "worker_sent_predicted": None, "counted_per_step": None,
        "server_recv": None, "server_recv_predicted": None, "server_recv_all": None,
    }
    ring = 2 * (workers - 1) / workers
    if variant == "dp":
        row["worker_sent_predicted"] = ring * P
    elif variant.startswith("local"):
        every = int(variant[len("local"):])
        row["worker_sent_predicted"] = ring * P / every
        row["counted_per_step"] = out.get("local_sgd_bytes_per_step")
    else:
        servers = 2 if variant == "ps2" else 1
        steps = out["client_steps"]
        row["worker_sent"] = out["client_bytes_sent"] / steps
        row["worker_sent_predicted"] = P
        row["counted_per_step"] = out["client_bytes_per_step"]
        per_server = [s["bytes_received"] / steps for s in out["servers"]]
        row["server_recv_all"] = per_server
        row["server_recv"] = max(per_server)
        row["server_recv_predicted"] = workers * P / servers
        row["server_versions"] = [s["version"] for s in out["servers"]]
        row["max_staleness"] = max(s["max_staleness"] for s in out["servers"])
    return row


def merge_repeats(reps: list[dict]) -> dict:
    """One row per case: the median step time (and CPU time) over repeats; bytes are the same
    in every repeat (the first one's)."""
    row = dict(reps[0])
    for key in ("step_ms", "cpu_ms_worker0"):
        row[key] = statistics.median(r[key] for r in reps)
    row["repeats_step_ms"] = [r["step_ms"] for r in reps]
    row["repeats_final_loss"] = [r["final_loss"] for r in reps]
    return row


def add_dp_ratios(rows: list[dict]) -> None:
    base = {r["workers"]: r["step_ms"] for r in rows if r["variant"] == "dp"}
    for r in rows:
        r["x_dp"] = r["step_ms"] / base[r["workers"]] if r["workers"] in base else None


def mib(value) -> str:
    return fmt(None if value is None else value / MIB, ".2f")


def format_scaling(rows: list[dict]) -> str:
    header = ("variant", "W", "procs", "ms/step", "x dp", "cpu ms", "sent MiB", "predicted",
              "counted MiB", "server recv MiB", "predicted")
    return table(header, [(
        LABELS[r["variant"]], str(r["workers"]), str(r["procs"]), f"{r['step_ms']:.1f}",
        fmt(r["x_dp"], ".2f"), f"{r['cpu_ms_worker0']:.1f}", mib(r["worker_sent"]),
        mib(r["worker_sent_predicted"]), mib(r["counted_per_step"]), mib(r["server_recv"]),
        mib(r["server_recv_predicted"]),
    ) for r in rows])


# -------------------------------------------------------------------------------------------------
# the loss curves
# -------------------------------------------------------------------------------------------------
def curve_row(variant: str, out: dict) -> dict:
    losses = out["losses"]
    tail = losses[-10:]
    return {"variant": variant, "losses": losses, "first": losses[0],
            "last10_mean": statistics.mean(tail), "final_loss": out["final_loss"],
            "run_s": out["run_s"]}


def format_curves(rows: list[dict], workers: int) -> str:
    header = ("variant", "W", "loss step 1", "mean of last 10 steps", "final model, all data")
    return table(header, [(LABELS[r["variant"]], str(workers), f"{r['first']:.4f}",
                           f"{r['last10_mean']:.4f}", f"{r['final_loss']:.4f}") for r in rows])


# -------------------------------------------------------------------------------------------------
# figures
# -------------------------------------------------------------------------------------------------
STYLE = {"dp": ("#4c72b0", "o"), "ps1": ("#dd8452", "s"), "ps2": ("#c44e52", "D"),
         "async": ("#8172b3", "^"), "local4": ("#55a868", "v"), "local16": ("#937860", "<")}


def _figure(size):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=120)
    FigureCanvasAgg(fig)
    return fig


def plot_steps(rows: list[dict], path: Path, title: str) -> Path:
    fig = _figure((11, 4.2))
    ax_t, ax_b = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        color, marker = STYLE[variant]
        ws = [r["workers"] for r in mine]
        ax_t.plot(ws, [r["step_ms"] for r in mine], marker=marker, color=color,
                  label=LABELS[variant])
        sent = [(r["worker_sent"] if r["worker_sent"] is not None
                 else r["worker_sent_predicted"]) / MIB for r in mine]
        ax_b.plot(ws, sent, marker=marker, color=color, label=f"{LABELS[variant]}: worker sends")
        if mine[0]["server_recv"] is not None:
            ax_b.plot(ws, [r["server_recv"] / MIB for r in mine], marker=marker, color=color,
                      linestyle="--", label=f"{LABELS[variant]}: busiest server receives")
    all_w = sorted({r["workers"] for r in rows})
    ax_t.set(xlabel="workers W", ylabel="ms per step (worker 0, median)", xticks=all_w,
             title="step time")
    ax_b.set(xlabel="workers W", ylabel="MiB per step", xticks=all_w,
             title="bytes per step (ps measured; dp / local SGD: ring formula)")
    ax_t.grid(alpha=0.3)
    ax_b.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_b.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_loss(rows: list[dict], workers: int, path: Path, title: str) -> Path:
    fig = _figure((7, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    for r in rows:
        color, _ = STYLE[r["variant"]]
        steps = range(1, len(r["losses"]) + 1)
        ax.plot(steps, r["losses"], color=color, alpha=0.25, linewidth=0.8)
        k = 10  # moving average over 10 steps
        smooth = [statistics.mean(r["losses"][max(0, i - k + 1):i + 1])
                  for i in range(len(r["losses"]))]
        dashed = r["variant"] == "ps1"  # sync ps retraces dp: dashed so that both show
        ax.plot(steps, smooth, color=color, label=LABELS[r["variant"]],
                linestyle="--" if dashed else "-", linewidth=1.2 if dashed else 2.0)
    ax.set(xlabel="optimizer step (worker's)", ylabel="training loss (mean of workers)",
           title=f"W = {workers} (faint: every step; bold: 10-step mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plots(result: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no figures")
        return []
    cfg = result["config"]
    title = (f"MLP {cfg['depth']} x Linear({cfg['width']}), {cfg['num_params'] / 1e6:.1f}M "
             f"params, AdamW, batch {cfg['batch']} per worker; gloo/TensorPipe CPU, "
             f"{result['machine']['cpus']} cores")
    paths = [plot_steps(result["scaling"], out_dir / "parameter_server_steps.png", title)]
    if result.get("curves"):
        paths.append(plot_loss(result["curves"], result["curve_workers"],
                               out_dir / "parameter_server_loss.png", title))
    return paths


# -------------------------------------------------------------------------------------------------
def report(result: dict) -> None:
    print(format_scaling(result["scaling"]))
    if result.get("curves"):
        print()
        print(format_curves(result["curves"], result["curve_workers"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=25, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every case, interleaved; medians (each ~8 s at W=4)")
    parser.add_argument("--curve-workers", type=int, default=2)
    parser.add_argument("--curve-steps", type=int, default=150, help="0: no loss curves")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per run")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: W = 1 2, 2 + 5 steps, width 256, 30-step curves")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"where the JSON and figures go (default {RESULTS}; "
                             "--quick writes nothing without it)")
    parser.add_argument("--from-json", type=Path, help="print and redraw a result; run nothing")
    args = parser.parse_args()

    if args.from_json:
        result = json.loads(args.from_json.read_text())
        report(result)
        for path in plots(result, args.from_json.parent):
            print(f"wrote {path}")
        return

    os.environ["OMP_NUM_THREADS"] = "1"  # the worker processes inherit it
    torch.set_num_threads(1)
    cfg = Config(width=args.width, depth=args.depth, batch=args.batch, warmup=args.warmup,
                 steps=args.steps)
    curve_steps = args.curve_steps
    if args.quick:
        cfg = replace(cfg, width=256, warmup=2, steps=5, data_size=1024)
        args.workers = [w for w in args.workers if w <= 2]
        curve_steps = min(curve_steps, 30)
    clock = WallClock()
    print(f"MLP {cfg.depth} x Linear({cfg.width}): {cfg.num_params / 1e6:.2f}M parameters, "
          f"{cfg.param_bytes / MIB:.2f} MiB fp32; batch {cfg.batch} per worker; "
          f"{cfg.warmup} warm-up + {cfg.steps} timed steps", flush=True)

    cases = [(w, v) for w in args.workers for v in args.variants
             if not (v.startswith("local") and w == 1)]  # local SGD on one process: the dp row
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for rep in range(args.repeats):  # interleaved: every case once per repeat
        for workers, variant in cases:
            out = run(variant, workers, cfg, cfg.warmup + cfg.steps, cfg.warmup + cfg.steps,
                      args.timeout)
            runs[workers, variant].append(scaling_row(variant, workers, cfg, out))
            print(f"  repeat {rep + 1}/{args.repeats} W={workers} {variant:8s} "
                  f"{runs[workers, variant][-1]['step_ms']:8.1f} ms/step "
                  f"(run took {out['run_s']:.1f} s)", flush=True)
    rows = [merge_repeats(runs[case]) for case in cases]
    add_dp_ratios(rows)

    curves = []
    if curve_steps:
        for variant in CURVE_VARIANTS:
            if variant not in args.variants:
                continue
            out = run(variant, args.curve_workers, cfg, curve_steps, 1,
                      args.timeout + curve_steps)
            curves.append(curve_row(variant, out))
            print(f"  curve W={args.curve_workers} {variant:8s} last-10 loss "
                  f"{curves[-1]['last10_mean']:.4f} (run took {out['run_s']:.1f} s)", flush=True)

    finished = clock.stop()
    result = {"machine": machine(**clock.loads(), wall_s=clock.wall_s),
              "config": {**asdict(cfg), "num_params": cfg.num_params,
                         "param_bytes": cfg.param_bytes},
              "repeats": args.repeats, "scaling": rows, "curve_workers": args.curve_workers, "curve_steps": curve_steps,
              "curves": curves}
    print()
    report(result)
    print(finished)
    if args.quick and args.out_dir is None:
        return
    out_dir = args.out_dir or RESULTS
    print(f"wrote {write_json(out_dir / 'parameter_server.json', result)}")
    for path in plots(result, out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
