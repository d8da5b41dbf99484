"""Pipeline bubble and step time of GPipe, 1F1B and interleaved 1F1B on 2 ranks.

Every schedule trains the same GPT (4 blocks) on the same global batch with AdamW, through
``meshtrain.parallel.pipeline.PipelineRunner`` on p = 2 processes (gloo, CPU, one torch thread
per rank), for m = 2, 4 and 8 micro-batches:

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019); one stage (2 blocks) per rank;
* ``1f1b``: one forward one backward in the steady state (PipeDream-Flush); one stage per rank;
* ``interleaved-1f1b``: v = 2 stages (1 block each) per rank, rank r holding stages r and r + 2
  (Narayanan et al. 2021).

Bubble: ``PipelineRunner.timed_step`` records every stage's forward (F) and backward (B) action
on every rank, and the last stage's loss (L, which the schedule computes between F and B); the
measured bubble is ``bubble_fraction``: per rank, 1 - (time in F, L and B) / (first start to last
end over all ranks), averaged over the ranks. Everything that is not compute counts as idle:
waiting for the other rank, but also the sends and receives and the schedule's own Python. The
formula is ``ideal_bubble_fraction``: (p-1)/(m+p-1), and (p-1)/(v*m+p-1) interleaved.

Sends: meshtrain's rows pass activations and gradients through shared memory, as the Trainer
does for CPU stages on one host (``local_comm="auto"``, meshtrain/parallel/shm/p2p.py); the
``gloo-p2p-*`` rows run the same stages on gloo's own send/recv (``local_comm="backend"``), the
``torch-loop-*`` row runs interleaved 1F1B on shared memory through torch's own action loop
instead of meshtrain's leaner one (meshtrain/parallel/pipeline/runtime.py), the ``raw-*`` rows
drive torch.distributed.pipelining directly on gloo (pipeline_peers.py). Host time per action: a
step's wall time minus its F/L/B compute minus the time spent waiting for p2p, per F or B
action: posting p2p, the schedule's Python, meshtrain's work.

Step time: forward + backward over all micro-batches + AdamW step + zero_grad, timed over
``--steps`` consecutive steps after ``--warmup`` untimed ones (the slower rank's clock). The
baselines run on rank 0 alone while rank 1 waits in a barrier, in the same processes, so that
they are interleaved with the pipelined runs: ``1proc`` is one process on the whole global batch
(one forward/backward), ``1proc xm`` the same batch as m micro-batches with gradient accumulation.
Repeats are interleaved (all cases, then all again); the table shows medians over repeats and,
for the ratios, medians of the per-repeat ratios ("paired").

    python benchmarks/pipeline.py            # 2 warm-up + 6 timed steps, 3 timelines, 5 repeats
    python benchmarks/pipeline.py --quick    # smoke run: tiny GPT, 1 repeat
    python benchmarks/pipeline.py --from-json benchmarks/results/pipeline.json   # redraw only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import (
    WallClock, end_process_group, fmt, hang_guard, in_ms, init_gloo, machine, mean_time,
    median_time, paired_ratio, slower_rank, table, write_json,
)

from pipeline_measure import timeline_events, handoffs, host_per_action, host_split
from pipeline_peers import RawSchedule

from meshtrain.launch.spawn import run_workers

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))  # (schedule, stages per rank)
PLOT_M = 4  # the timelines drawn (else the smallest m run)
RAW = (("1f1b", 1), ("interleaved-1f1b", 2))  # raw torch.distributed.pipelining, at the largest m
# meshtrain's stages on gloo's own send/recv (local_comm="backend"), at the largest m: the "before"
GLOO_P2P = (("1f1b", 1), ("interleaved-1f1b", 2))
# the same on shared memory through torch's own action loop (1F1B and GPipe have only that)
TORCH_LOOP = (("interleaved-1f1b", 2),)


@dataclass(frozen=True)
class Config:
    steps: int = 6  # timed steps per case and repeat
    warmup: int = 2  # untimed steps before them
    timelines: int = 3  # timed_step() calls per case and repeat (bubble: their median)
    global_batch_size: int = 16
    seq_len: int = 64
    d_model: int = 192
    num_heads: int = 4
    num_layers: int = 4  # at least 2 per rank (interleaved: 2 stages per rank)
    pp: int = 2  # ranks
    vocab_size: int = 256
    microbatches: tuple[int, ...] = (2, 4, 8)
    lr: float = 1e-3
    seed: int = 0

    def gpt_config(self):
        from meshtrain.models.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len,
                         num_layers=self.num_layers, num_heads=self.num_heads,
                         d_model=self.d_model)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def case_name(schedule: str, m: int) -> str:
    return f"{schedule} m={m}"


def even_splits(num_blocks: int, num_stages: int) -> list[int]:
    return [num_blocks * k // num_stages for k in range(1, num_stages)]


# -------------------------------------------------------------------------------------------------
# the run (on every rank)
# -------------------------------------------------------------------------------------------------
def pipeline_worker(cfg: Config, repeats: int, hang_s: float) -> dict:
    """Every case (and, on rank 0, the baselines) ``repeats`` times, interleaved."""
    with hang_guard(hang_s):
        return _pipeline_cases(cfg, repeats, init_gloo(hang_s))


def _pipeline_cases(cfg: Config, repeats: int, rank: int) -> dict:
    import torch.distributed as dist

    from meshtrain.models.gpt import GPT
    from meshtrain.parallel.pipeline import PipelineRunner, rank_stages, split_model
    from meshtrain.parallel.shm.p2p import local_p2p_group

    group = dist.group.WORLD
    shm = local_p2p_group([list(range(cfg.pp))], torch.device("cpu"), "auto")  # the Trainer's
    assert shm is not None, "shared memory is not reachable by both ranks"
    gen = torch.Generator().manual_seed(1234)
    x = torch.randint(0, cfg.vocab_size, (cfg.global_batch_size, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (cfg.global_batch_size, cfg.seq_len), generator=gen)

    def adamw(params):
        return torch.optim.AdamW(params, lr=cfg.lr)

    runners = {}
    top = max(cfg.microbatches)
    variants = [(schedule, v, m, shm, case_name(schedule, m))
                for m in cfg.microbatches for schedule, v in SCHEDULES]
    variants += [(schedule, v, top, None, case_name(f"gloo-p2p-{schedule}", top))
                 for schedule, v in GLOO_P2P]
    variants += [(schedule, v, top, shm, case_name(f"torch-loop-{schedule}", top))
                 for schedule, v in TORCH_LOOP]
    for schedule, v, m, p2p, name in variants:
        num_stages = cfg.pp * v
        indices = rank_stages(rank, cfg.pp, v, schedule)
        model = GPT(cfg.gpt_config(), seed=cfg.seed)
        points = even_splits(cfg.num_layers, num_stages)
        stages = [split_model(model, points, i) for i in indices]
        runner = PipelineRunner(stages, indices, num_stages, group, torch.device("cpu"),
                                schedule=schedule, num_microbatches=m, loss_fn=lm_loss,
                                p2p_group=p2p)
        runner.schedule.lean = not name.startswith("torch-loop")
        runners[name] = runner, adamw(runner.parameters())
    for schedule, v in RAW:  # the peer (pipeline_peers.py), on the same stage modules
        num_stages, m = cfg.pp * v, max(cfg.microbatches)
        indices = rank_stages(rank, cfg.pp, v, schedule)
        model = GPT(cfg.gpt_config(), seed=cfg.seed)
        stages = [split_model(model, even_splits(cfg.num_layers, num_stages), i) for i in indices]
        runner = RawSchedule(stages, indices, num_stages, group, schedule=schedule,
                             num_microbatches=m, loss_fn=lm_loss)
        runners[case_name(f"raw-{schedule}", m)] = runner, adamw(runner.parameters())
    if rank == 0:
        reference = GPT(cfg.gpt_config(), seed=cfg.seed)
        ref_opt = adamw(reference.parameters())

    def pipeline_step(runner, opt):
        runner.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def baseline_step(m):
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (lm_loss(reference(xs), ys) / m).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    out: dict = {"rank": rank, "step_s": {}, "timelines": {}, "idle_cpu_s": [],
                 "send_recv_ms": {}, "shm_send_recv_ms": {}, "host": {}}
    # the cost of handing one micro-batch's activation to the other rank (ping-pong, halved),
    # on gloo and through shared memory
    for m in cfg.microbatches:
        buf = torch.randn(cfg.global_batch_size // m, cfg.seq_len, cfg.d_model)
        for key, g in (("send_recv_ms", group), ("shm_send_recv_ms", shm)):
            def ping_pong():  # between ranks 0 and 1 (any others wait in the barrier)
                if rank == 0:
                    dist.send(buf, 1, group=g)
                    dist.recv(buf, 1, group=g)
                elif rank == 1:
                    dist.recv(buf, 0, group=g)
                    dist.send(buf, 0, group=g)

            out[key][m] = 1e3 * median_time(ping_pong, before=dist.barrier) / 2
    baselines = {"1proc": 1, **{f"1proc x{m}": m for m in cfg.microbatches}}
    cases = [case_name(schedule, m) for m in cfg.microbatches for schedule, _ in SCHEDULES]
    cases += [case_name(f"gloo-p2p-{schedule}", top) for schedule, _ in GLOO_P2P]
    cases += [case_name(f"torch-loop-{schedule}", top) for schedule, _ in TORCH_LOOP]
    cases += [case_name(f"raw-{schedule}", top) for schedule, _ in RAW]
    for _ in range(repeats):
        for name in cases:
            runner, opt = runners[name]
            dist.barrier()
            mean_time(lambda: pipeline_step(runner, opt), cfg.warmup)
            dist.barrier()
            out["step_s"].setdefault(name, []).append(
                mean_time(lambda: pipeline_step(runner, opt), cfg.steps))
            for _ in range(cfg.timelines):
                _, events = runner.timed_step(x, y)
                out["timelines"].setdefault(name, []).append(
                    [(e.rank, e.stage, e.microbatch, e.kind, e.start, e.end) for e in events])
                opt.zero_grad(set_to_none=True)
            for _ in range(cfg.timelines):
                dist.barrier()
                out["host"].setdefault(name, []).append(host_split(runner, x, y))
                opt.zero_grad(set_to_none=True)
        # The baselines: rank 0 alone; rank 1 waits in the barrier (its CPU time is recorded).
        dist.barrier()
        cpu = time.process_time()
        if rank == 0:
            for name, m in baselines.items():
                mean_time(lambda: baseline_step(m), cfg.warmup)
                out["step_s"].setdefault(name, []).append(
                    mean_time(lambda: baseline_step(m), cfg.steps))
        dist.barrier()
        out["idle_cpu_s"].append(time.process_time() - cpu)
    end_process_group()  # while the runners are alive
    return out


def run(cfg: Config, repeats: int, timeout: float) -> list[dict]:
    return run_workers(pipeline_worker, cfg.pp, (cfg, repeats, max(1.0, timeout - 10)),
                       timeout=timeout, threads=1)


# -------------------------------------------------------------------------------------------------
# summary, table, charts
# -------------------------------------------------------------------------------------------------
def summarize(cfg: Config, ranks: list[dict]) -> dict:
    from meshtrain.parallel.pipeline import bubble_fraction, ideal_bubble_fraction, replay

    step_s = slower_rank(ranks, "step_s")  # the baselines ran on rank 0 only
    summary: dict[str, dict] = {}
    top = max(cfg.microbatches)
    for m in cfg.microbatches:
        gpipe = step_s[case_name("gpipe", m)]
        send_ms, shm_send_ms = ranks[0]["send_recv_ms"][m], ranks[0]["shm_send_recv_ms"][m]
        raw = [(f"gloo-p2p-{schedule}", v) for schedule, v in GLOO_P2P] if m == top else []
        raw += [(f"torch-loop-{schedule}", v) for schedule, v in TORCH_LOOP] if m == top else []
        raw += [(f"raw-{schedule}", v) for schedule, v in RAW] if m == top else []
        for schedule, v in [*SCHEDULES, *raw]:
            name = case_name(schedule, m)
            timelines = ranks[0]["timelines"][name]
            bubbles = [bubble_fraction(timeline_events(t)) for t in timelines]
            spans = [max(e[5] for e in t) - min(e[4] for e in t) for t in timelines]
            formula = ideal_bubble_fraction(cfg.pp, m, v)
            # idle time beyond the formula's, per F or B action of a rank (2*v*m of them)
            excess = [(b - formula) * s / (2 * v * m) for b, s in zip(bubbles, spans)]
            median_bubble = statistics.median(bubbles)
            chosen = min(range(len(bubbles)), key=lambda i: abs(bubbles[i] - median_bubble))
            events = timeline_events(timelines[chosen])
            times = step_s[name]
            host = host_per_action(ranks, name, 2 * v * m)
            handoff_ms = statistics.median(h[-1] for t in timelines for h in handoffs(t))
            # the same recorded actions replayed: with free communication and no host work
            # (what the schedule and these stage times leave), and with the handoff and the host
            # time per action measured here (how much of the bubble those two explain)
            replayed = [bubble_fraction(replay(timeline_events(t))) for t in timelines]
            with_costs = [bubble_fraction(replay(timeline_events(t), handoff_s=handoff_ms / 1e3,
                                                 host_s=host["host_ms_per_action"] / 1e3))
                          for t in timelines]
            summary[name] = {
                "schedule": schedule, "m": m, "v": v,
                "bubble": median_bubble, "bubbles": bubbles, "formula": formula,
                "replay_bubble": statistics.median(replayed),
                "replay_with_costs_bubble": statistics.median(with_costs),
                **in_ms(times),
                "x_gpipe": paired_ratio(times, gpipe),
                # meshtrain's row against the raw schedule's, where one ran
                "x_raw": (paired_ratio(times, step_s[case_name(f"raw-{schedule}", m)])
                          if (schedule, v) in RAW and m == top else None),
                # against the same stages on gloo's send/recv (local_comm="backend"), where one ran
                "x_gloo_p2p": (paired_ratio(times, step_s[case_name(f"gloo-p2p-{schedule}", m)])
                               if (schedule, v) in GLOO_P2P and m == top else None),
                # against the same stages run by torch's own action loop
                "x_torch_loop": (paired_ratio(times,
                                              step_s[case_name(f"torch-loop-{schedule}", m)])
                                 if (schedule, v) in TORCH_LOOP and m == top else None),
                "x_1proc": paired_ratio(times, step_s["1proc"]),
                "x_1proc_accum": paired_ratio(times, step_s[f"1proc x{m}"]),
                # with equal stages and no communication: (v*m+p-1)/(p*v*m) of one process
                # running the same micro-batches one after the other
                "formula_x_1proc_accum": (v * m + cfg.pp - 1) / (cfg.pp * v * m),
                "f_ms": 1e3 * statistics.mean(e.end - e.start for e in events if e.kind == "F"),
                "b_ms": 1e3 * statistics.mean(e.end - e.start for e in events if e.kind == "B"),
                "l_ms": 1e3 * statistics.mean(e.end - e.start for e in events if e.kind == "L"),
                "span_ms": 1e3 * (max(e.end for e in events) - min(e.start for e in events)),
                "excess_ms_per_action": 1e3 * statistics.median(excess),
                "handoff_ms": handoff_ms,
                # the first of the step: stage 0's first forward output to stage 1
                "first_handoff_ms": statistics.median(
                    h[-1] for t in timelines for h in handoffs(t) if h[:3] == (1, 0, "F")),
                # per F or B action (2*v*m per rank), the slower rank's median: host time
                # (posting p2p + the schedule's Python + meshtrain's), and its posting part
                **host,
                "send_ms": send_ms,  # one activation (or its gradient) to the other rank
                "shm_send_ms": shm_send_ms,  # the same through shared memory
                "timeline": timelines[chosen],
            }
    for name in ("1proc", *(f"1proc x{m}" for m in cfg.microbatches)):
        summary[name] = in_ms(step_s[name])
    return summary


def format_table(summary: dict) -> str:
    """Two tables: the bubble (and what it is made of), then step times and their ratios."""
    cases = [row for row in summary.values() if "schedule" in row]
    bubble = table(
        ("schedule", "v", "m", "bubble", "formula", "x formula", "replay", "replay+costs",
         "excess/action ms", "F ms", "L ms", "B ms", "host/action ms", "post/action ms",
         "send ms", "shm send ms", "handoff ms", "1st handoff ms"),
        [(r["schedule"], str(r["v"]), str(r["m"]), f"{r['bubble']:.3f}", f"{r['formula']:.3f}",
          f"{r['bubble'] / r['formula']:.2f}", fmt(r.get("replay_bubble"), ".3f"),
          fmt(r.get("replay_with_costs_bubble"), ".3f"),
          f"{r['excess_ms_per_action']:.2f}", f"{r['f_ms']:.1f}",
          f"{r.get('l_ms', float('nan')):.2f}", f"{r['b_ms']:.1f}",
          f"{r.get('host_ms_per_action', float('nan')):.3f}",
          f"{r.get('post_ms_per_action', float('nan')):.3f}",
          f"{r['send_ms']:.2f}", f"{r.get('shm_send_ms', float('nan')):.2f}",
          f"{r['handoff_ms']:.2f}", f"{r['first_handoff_ms']:.2f}")
         for r in cases])
    rows = [(r["schedule"], str(r["v"]), str(r["m"]), f"{r['median_ms']:.1f}",
             f"{r['x_gpipe']:.3f}", f"{r['x_1proc']:.3f}", f"{r['x_1proc_accum']:.3f}",
             f"{r['formula_x_1proc_accum']:.3f}",
             "-" if r.get("x_raw") is None else f"{r['x_raw']:.3f}",
             "-" if r.get("x_gloo_p2p") is None else f"{r['x_gloo_p2p']:.3f}",
             "-" if r.get("x_torch_loop") is None else f"{r['x_torch_loop']:.3f}") for r in cases]
    rows += [(name, "-", "-", f"{row['median_ms']:.1f}", "-", "-", "-", "-", "-", "-", "-")
             for name, row in summary.items() if "schedule" not in row]
    times = table(("schedule", "v", "m", "ms/step", "x gpipe", "x 1proc", "x 1proc xm",
                   "ideal x 1proc xm", "x raw", "x gloo p2p", "x torch loop"), rows)
    return f"{bubble}\n\n{times}"


def plot_all(summary: dict, out_dir: Path, title: str, pp: int) -> list[Path]:
    """The timeline of each schedule at m=4 (the median-bubble step) and bubble vs m."""
    from pipeline_plots import plot_bubble, plot_timelines

    runs = {row["m"] for row in summary.values() if isinstance(row, dict) and "m" in row}
    plot_m = PLOT_M if PLOT_M in runs else min(runs)
    return [*plot_timelines(summary, out_dir, SCHEDULES, plot_m, pp, case_name, timeline_events),
            plot_bubble(summary, out_dir, title, SCHEDULES)]


# -------------------------------------------------------------------------------------------------
# driver
# -------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case (6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--timelines", type=int, default=3,
                        help="recorded steps per case and repeat for the bubble (3)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (5)")
    parser.add_argument("--d-model", type=int, default=192, help="GPT width (192)")
    parser.add_argument("--num-layers", type=int,
                        help="GPT blocks, split evenly over the stages (4, or 2 per rank with "
                             "--pp above 2; at least 2 per rank)")
    parser.add_argument("--microbatches", default="2,4,8", help="values of m (2,4,8)")
    parser.add_argument("--pp", type=int, default=2,
                        help="ranks (2; more: a GPT of 2 blocks per rank, results in "
                             "<out-dir>/pp<N>/)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: d_model 64, 1 warm-up + 2 timed steps, 1 repeat")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a hung run is killed")
    parser.add_argument("--out-dir", default="benchmarks/results",
                        help="where pipeline.json and the PNGs go")
    parser.add_argument("--from-json", help="only redraw table and charts from pipeline.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.timelines, args.repeats, args.d_model = 2, 1, 1, 1, 64
    args.microbatches = tuple(int(m) for m in args.microbatches.split(","))
    if min(args.steps, args.warmup, args.timelines, args.repeats) < 1:
        parser.error("--steps, --warmup, --timelines and --repeats must be >= 1")
    batch = Config.global_batch_size
    if args.pp < 2:
        parser.error("--pp must be at least 2")
    args.num_layers = args.num_layers or max(Config.num_layers, 2 * args.pp)
    if args.num_layers < 2 * args.pp:
        parser.error(f"--num-layers must be at least 2 per rank ({2 * args.pp} for --pp "
                     f"{args.pp}): interleaved 1F1B puts 2 stages on each rank")
    if any(m % args.pp or batch % m for m in args.microbatches):
        parser.error(f"micro-batch counts must be multiples of {args.pp} that divide the global "
                     f"batch of {batch}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        print(format_table(result["summary"]))
        for path in plot_all(result["summary"], out_dir, result["title"],
                             result["config"].get("pp", 2)):
            print(f"wrote {path}")
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = Config(steps=args.steps, warmup=args.warmup, timelines=args.timelines,
                 d_model=args.d_model, microbatches=args.microbatches, pp=args.pp,
                 num_layers=args.num_layers)
    if args.pp != 2:
        out_dir = out_dir / f"pp{args.pp}"
    from meshtrain.models.gpt import GPT

    num_params = GPT(cfg.gpt_config()).num_params()
    title = (f"{cfg.pp} ranks (gloo, CPU, 1 thread each), GPT {cfg.num_layers} blocks "
             f"d={cfg.d_model} seq={cfg.seq_len} vocab={cfg.vocab_size} ({num_params / 1e6:.2f}M params), "
             f"global batch {cfg.global_batch_size}")
    print(f"pipeline benchmark: {title}; m in {list(cfg.microbatches)}, {cfg.warmup} warm-up + "
          f"{cfg.steps} timed steps + {cfg.timelines} timelines per case, {args.repeats} "
          f"repeats, torch {torch.__version__}", flush=True)
    clock = WallClock()
    ranks = run(cfg, args.repeats, args.timeout)
    print(f"({clock.stop()}; rank 1 used {statistics.median(ranks[1]['idle_cpu_s']):.2f} s CPU "
          f"while waiting for the baselines)\n")
    summary = summarize(cfg, ranks)
    print(format_table(summary))
    paths = plot_all(summary, out_dir, title, cfg.pp)
    result = {
        "title": title,
        "config": asdict(cfg) | {"num_params": num_params},
        "repeats": args.repeats,
        "machine": machine(**clock.loads()),
        "summary": summary,
        "idle_rank_cpu_s": ranks[1]["idle_cpu_s"],
    }
    json_path = write_json(out_dir / "pipeline.json", result)
    print(f"\nwrote {json_path}, " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
