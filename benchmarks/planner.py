"""How good ``meshtrain plan`` is here: every layout of its table for a small GPT on 4 CPU
processes actually trained for a few steps, measured, and compared with the estimates.

For each distinct layout the planner's own best variant of it (micro-batch, checkpointing,
schedule) is run through ``Trainer`` on 4 fresh processes (gloo, one torch thread each); every
rank measures its step time (median of the timed steps, the slowest rank's; the median of the
passes below) and its peak resident memory during ``fit`` above its resident size before
(``meshtrain.observe.memory.peak_rss.PeakRSS``); a second run of 2 steps measures the peak bytes
of live tensors (``meshtrain.observe.memory.tensor_peak.TensorPeak``, which slows every
operator, so not in the timed run; it includes the shared-memory rings): what the estimate
counts, with the cluster's allowance at 0. Runs are made with ``report=False``: the report
page costs rank 0 about 40 MiB more at the end of ``fit`` (matplotlib and Jinja2 imported and
drawn; 80 against 41 MiB resident for the smallest GPT on 4 processes, 2026-11-28), which the
estimate does not count.

Memory is judged twice: against live tensors (what the estimate counts without an allowance)
and against the resident peak, the estimate with the allowance measured here first on runs
that are not in the table (:func:`allowance`): ``reserved``, what a training process holds
besides its tensors, and ``heap_keep``, the part of the freed activations and transients the
host allocator keeps resident, by layout family (measured on another GPT, half the blocks, in
the first layout of each family the table has). Both depend on the allocator the processes
run on: glibc's heap keeps far more than jemalloc (``LD_PRELOAD=.../libjemalloc.so.2``); the
JSON records which, and ``Cluster.preset("this-machine")`` reads the allowance back for the
same allocator.

Before it plans, it measures what a cp collective waits inside a step here (benchmarks/cp_sync.py,
a job outside the table) and how much of the cores a pipeline's processes keep busy against data
parallel's (benchmarks/pp_core_use.py, another), and gives both to the estimate
(``Cluster.cp_sync``, ``Cluster.pp_core_use``); the JSON keeps them for
``Cluster.preset("this-machine")``.

* pick/best: measured step time of the planner's pick over the fastest measured (goal <= 1.10);
* tau: Kendall's tau between the predicted and the measured order of step times (goal >= 0.7);
* mem_under_max: the largest amount by which an estimate falls short of the measured peak, in
  percent of the measured (goal <= 5); mem_err_mean: mean absolute error in percent (<= 10).
  The last line (``planner: pick/best=...``) judges the estimate with its allowance against
  the resident peak, what a user sizes a job by; the line before it, the estimate without an
  allowance against live tensors (the JSON keeps both: ``rss_*`` and ``mem_*``).

Step times and peaks are the median of ``--passes`` passes over all the layouts (each pass runs
every layout once, in the same order, so a burst of another job on the machine hits one pass of
a few layouts, not a layout's every run); pick/best and tau are also given per pass, and the
estimate's shortfall against each layout's largest peak of any pass, as their spread (a
sharded layout's peak of live tensors moved by up to 8 % between runs of the same code: FSDP's
shared-memory rings grow, or not, with how soon a peer reads, which the estimate now counts at
the larger size: ``meshtrain.parallel.shm.p2p.ring_bytes``).

    python benchmarks/planner.py [--steps 8] [--passes 3] [--out results/planner.json]
    python benchmarks/planner.py --calibrations 5   # only the one-block calibration's spread
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cp_sync import cp_sync, summary
from harness import end_process_group, machine, table, token_pairs, write_json
from pp_core_use import pp_core_use
from pp_core_use import summary as core_use_summary

from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.layout import Layout
from meshtrain.plan.candidate import Candidate
from meshtrain.plan.cluster import Cluster, heap_family, host_allocator
from meshtrain.plan.estimate import Estimator, Job
from meshtrain.plan.model_spec import ModelSpec
from meshtrain.plan.planner import plan

WORLD = 4
MODEL = "gpt:num_layers=4,num_heads=4,d_model=256,vocab_size=2048,seq_len=128"
# the model the allowance by layout family is measured on (not the judged one)
ALLOWANCE_MODEL = "gpt:num_layers=2,num_heads=4,d_model=256,vocab_size=2048,seq_len=128"
GLOBAL_BATCH, SEQ = 16, 128


def worker(model: str, settings: dict, steps: int, tensors: bool = False) -> dict:
    from meshtrain import Trainer, losses
    from meshtrain.callbacks import Callback
    from meshtrain.observe.memory.peak_rss import PeakRSS
    from meshtrain.observe.memory.tensor_peak import TensorPeak

    spec = ModelSpec.load(model)

    class Clock(Callback):
        def __init__(self):
            self.ends = []

        def on_train_step_end(self, trainer, metrics):
            self.ends.append(time.perf_counter())

    data = token_pairs(spec.vocab_size, GLOBAL_BATCH * (steps + 1), SEQ)
    clock = Clock()
    with tempfile.TemporaryDirectory() as run_dir, (TensorPeak() if tensors else PeakRSS()) as peak:
        trainer = Trainer(accelerator="cpu", max_steps=steps, global_batch_size=GLOBAL_BATCH,
                          callbacks=[clock], loggers=(), progress_bar=False,
                          save_final_checkpoint=False, log_every_n_steps=steps, run_dir=run_dir,
                          report=False, **settings)
        trainer.fit(lambda: spec.build(), data,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    loss_fn=losses.cross_entropy())
        rings = tp_rings(trainer) if tensors else 0  # (RSS holds the pages it touched)
        end_process_group()
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    # (TensorPeak sees the tp axis's rings too now: local_comm="backend" 90.7 MiB per rank
    # for dp=2,tp=2 mb=8, "auto" 106.7 = 90.7 + the 16 MiB of rings; reported, not added)
    return {"step_s": statistics.median(gaps[1:] or gaps), "peak": peak.bytes,
            "tp_rings": rings}


def tp_rings(trainer) -> int:
    """Bytes of the rings the tp axis's shared-memory group maps (shm/collectives.py): memory
    the estimate counts (TensorPeak's peak includes them: 2026-11-28)."""
    from meshtrain.parallel.shm.collectives import SharedMemoryCollectives

    mesh = trainer.mesh
    if mesh is None or mesh.layout.degree("tp") == 1:
        return 0
    group = mesh.mesh.get_group("tp")
    return group.mapped_bytes() if isinstance(group, SharedMemoryCollectives) else 0


def measure(model: str, settings: dict, steps: int, world: int = WORLD) -> dict:
    ranks = run_workers(worker, world, (model, settings, steps), timeout=600, threads=1)
    tensors = run_workers(worker, world, (model, settings, 2, True), timeout=600, threads=1)
    return {"step_s": max(r["step_s"] for r in ranks), "rss": max(r["peak"] for r in ranks),
            "peak": max(r["peak"] for r in tensors), "ranks": ranks, "tensor_ranks": tensors}


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1)
                for i, j in pairs if a[i] != a[j] and b[i] != b[j])
    return score / max(1, len(pairs))


def calibrations(spec, n: int) -> int:
    """The one-block calibration (meshtrain.plan.calibrate) made ``n`` times afresh: a pass at 16
    sequences of one process's block, and of a tp=4, tp=2 and cp=4 rank's over it."""
    from meshtrain.plan import calibrate

    for i in range(n):
        calibrate._timing.cache_clear()
        getattr(calibrate, "_reference", calibrate._timing).cache_clear()  # (older code: none)
        start, passes = time.perf_counter(), {}
        for tp, cp in ((1, 1), (4, 1), (2, 1), (1, 4)):
            fixed, per_sample, _ = calibrate._timing(spec, tp, cp, False, SEQ)
            passes[tp, cp] = fixed + 16 * per_sample
        ref = passes.pop((1, 1))
        print(f"calibration {i + 1}: one process {ref * 1e3:.0f} ms; " + ", ".join(
            f"tp={tp},cp={cp} {t / ref:.3f}" for (tp, cp), t in passes.items())
            + f" of it ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/planner.json"))
    parser.add_argument("--limit", type=int, help="run only the first N layouts (smoke)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes over the layouts")
    parser.add_argument("--calibrations", type=int, metavar="N",
                        help="only calibrate N times, fresh each time: the spread of a tp x cp "
                             "rank's compute relative to one process's")
    args = parser.parse_args(argv)
    spec, job = ModelSpec.load(MODEL), Job(GLOBAL_BATCH, SEQ)
    if args.calibrations:
        return calibrations(spec, args.calibrations)
    # what a cp collective waits inside a step here (a job outside the table: cp_sync.py)
    cluster = Cluster.preset("this-machine", processes=WORLD)
    sync = cp_sync(WORLD, cluster, args.steps)
    print(summary(sync), flush=True)
    # and how much of the cores a pipeline keeps busy against data parallel (pp_core_use.py)
    core_use = pp_core_use(WORLD, args.steps)
    print(core_use_summary(core_use), flush=True)
    # the estimate as it counts live tensors (judged against TensorPeak), planned first: its
    # calibration times the model here, on a machine no worker of ours is busy on
    # (none of the allowance read back from an earlier run: its by-family fractions too)
    cluster = dataclasses.replace(cluster, reserved=0, heap_keep=0.0, heap_keep_by_family=None,
                                  cp_sync=sync["cp_sync"], pp_core_use=core_use["pp_core_use"])
    estimator = Estimator(spec, cluster, job)
    result = plan(spec, cluster, job, estimator=estimator)
    best_of_layout: dict[str, object] = {}
    for row in result.rows:  # fastest first: the first row of each layout is its best variant
        best_of_layout.setdefault(row.candidate.layout, row)
    rows = list(best_of_layout.values())[:args.limit]
    base, heap_keep, families = allowance(spec, job, args.steps, [e.candidate for e in rows])
    print(f"allowance ({host_allocator()}): {base / 2**20:.1f} MiB a training process holds "
          f"besides its tensors (the smallest GPT on {WORLD} processes), heap_keep "
          f"{heap_keep:.2f} of the activations and transients (the GPT in one process); by "
          f"family (the {ALLOWANCE_MODEL.split(':')[1].split(',')[0]} GPT): "
          + ", ".join(f"{f} {k:.2f}" for f, k in families.items()), flush=True)
    # and with the measured allowance (judged against the resident peak)
    resident_cluster = dataclasses.replace(cluster, reserved=base, heap_keep=heap_keep,
                                           heap_keep_by_family=families)
    measured = []
    for e in rows:
        m = measure(MODEL, e.candidate.settings(), args.steps)
        measured.append(m)
        print(f"{str(e.candidate):<44} predicted {e.step_seconds:7.3f} s {e.memory_total / 2**20:7.1f}"
              f" MiB   measured {m['step_s']:7.3f} s {m['peak'] / 2**20:7.1f} MiB (resident "
              f"{m['rss'] / 2**20:.1f})", flush=True)
    for m in measured:
        m["step_s_passes"], m["peak_passes"], m["rss_passes"] = [m["step_s"]], [m["peak"]], \
            [m["rss"]]
    for _ in range(args.passes - 1):  # more passes, in the same order: the median counts
        for e, m in zip(rows, measured):
            again = measure(MODEL, e.candidate.settings(), args.steps)
            for key in ("step_s", "peak", "rss"):
                m[f"{key}_passes"].append(again[key])
    for m in measured:
        for key in ("step_s", "peak", "rss"):
            m[key] = statistics.median(m[f"{key}_passes"])
    times = [m["step_s"] for m in measured]
    pick_over_best = times[0] / min(times)
    predicted = [e.step_seconds for e in rows]
    tau = kendall_tau(predicted, times)
    passes = [[m["step_s_passes"][p] for m in measured] for p in range(args.passes)]
    spread = {"pick_over_best": [t[0] / min(t) for t in passes],
              "tau": [kendall_tau(predicted, t) for t in passes]}
    errors = [(e.memory_total - m["peak"]) / m["peak"] * 100 for e, m in zip(rows, measured)]
    under = max([0.0] + [-x for x in errors])
    under_any_pass = max([0.0] + [(max(m["peak_passes"]) - e.memory_total) /
                                  max(m["peak_passes"]) * 100 for e, m in zip(rows, measured)])
    mean_err = statistics.mean(abs(x) for x in errors)
    resident_estimator = Estimator(spec, resident_cluster, job)
    with_allowance = [resident_estimator.estimate(e.candidate).memory_total for e in rows]
    resident = [(r - m["rss"]) / m["rss"] * 100 for r, m in zip(with_allowance, measured)]
    rss_under = max([0.0] + [-x for x in resident])
    rss_err = statistics.mean(abs(x) for x in resident)
    print(table(["layout", "pred s", "meas s", "passes", "pred MiB", "tensors MiB", "err %",
                 "+allowance MiB", "RSS MiB", "err %"],
                [[str(e.candidate), f"{e.step_seconds:.3f}", f"{m['step_s']:.3f}",
                  "/".join(f"{t:.2f}" for t in m["step_s_passes"]),
                  f"{e.memory_total / 2**20:.1f}", f"{m['peak'] / 2**20:.1f}", f"{x:+.1f}",
                  f"{a / 2**20:.1f}", f"{m['rss'] / 2**20:.1f}", f"{r:+.1f}"]
                 for e, m, x, r, a in zip(rows, measured, errors, resident, with_allowance)]))
    write_json(args.out, {"machine": machine(), "model": MODEL, "world": WORLD,
                          "global_batch": GLOBAL_BATCH, "seq_len": SEQ,
                          "rows": [
                              {"candidate": str(e.candidate), "predicted_s": e.step_seconds,
                               "predicted_seconds": e.seconds, "predicted_memory": e.memory,
                               "measured": m} for e, m in zip(rows, measured)],
                          "pick_over_best": pick_over_best, "tau": tau,
                          "mem_under_max": under, "mem_err_mean": mean_err,
                          "mem_under_max_any_pass": under_any_pass,
                          "passes": spread, "resident_base": base,
                          "allowance": {"allocator": host_allocator(), "reserved": base,
                                        "heap_keep": heap_keep, "families": families,
                                        "families_model": ALLOWANCE_MODEL},
                          "rss_under_max": rss_under, "rss_err_mean": rss_err,
                          "cp_sync": sync, "pp_core_use": core_use})
    print(f"per pass: pick/best {' '.join(f'{x:.2f}' for x in spread['pick_over_best'])}, "
          f"tau {' '.join(f'{x:.2f}' for x in spread['tau'])}; live tensors under the largest "
          f"peak of any pass: {under_any_pass:.1f}%")
    print(f"planner (live tensors, no allowance): mem_under_max={under:.1f}% "
          f"mem_err_mean={mean_err:.1f}%")
    print(f"planner (memory against the resident peak: live tensors + {base / 2**20:.1f} MiB + "
          f"the family's fraction of activations and transients, {host_allocator()}):")
    print(f"planner: pick/best={pick_over_best:.2f} tau={tau:.2f} mem_under_max={rss_under:.1f}% "
          f"mem_err_mean={rss_err:.1f}%")
    return 0


def allowance(spec, job, steps: int, candidates) -> tuple[int, float, dict[str, float]]:
    """The memory a training process holds here besides its live tensors, measured on runs
    that are not among the judged ones: ``reserved``, what a process of the smallest GPT
    holds above its tensors on the same processes (the process group and its threads, what the
    Trainer imports and keeps); ``heap_keep``, the fraction of the job's activations and
    transients the host allocator still holds after freeing them, from the job's model trained
    in one process (its resident peak less its live tensors and ``reserved``, over its
    estimated activations and transients); and the same fraction by layout family
    (``meshtrain.plan.cluster.heap_family``), each from the first of ``candidates`` of that
    family run on :data:`ALLOWANCE_MODEL`, another GPT (half the blocks): glibc's heap keeps
    0.4-1.8 of the activations depending on how a layout allocates (the context-parallel
    rows the most: 2026-11-30), which one fraction could not place."""
    tiny = "gpt:num_layers=2,num_heads=2,d_model=16,vocab_size=32,seq_len=128"
    small = measure(tiny, {"layout": f"dp={WORLD}"}, steps)
    reserved = small["rss"] - small["peak"]
    one = {"layout": "dp=1", "micro_batch_size": 4}
    alone = measure(MODEL, one, steps, world=1)
    bare = dataclasses.replace(Cluster.preset("this-machine", processes=1), reserved=0,
                               heap_keep=0.0, heap_keep_by_family=None)
    memory = Estimator(spec, bare, job).estimate(Candidate("dp=1", 4)).memory
    kept = alone["rss"] - alone["peak"] - reserved
    heap_keep = max(0.0, kept / (memory["activations"] + memory["transient"]))
    other = ModelSpec.load(ALLOWANCE_MODEL)
    bare = dataclasses.replace(Cluster.preset("this-machine", processes=WORLD), reserved=0,
                               heap_keep=0.0, heap_keep_by_family=None)
    families: dict[str, float] = {}
    for c in candidates:
        family = heap_family(Layout.parse(c.layout, WORLD))
        if family in families:
            continue
        m = measure(ALLOWANCE_MODEL, c.settings(), steps)
        memory = Estimator(other, bare, job).estimate(c).memory
        families[family] = max(0.0, (m["rss"] - m["peak"] - reserved)
                               / (memory["activations"] + memory["transient"]))
    return reserved, heap_keep, families


if __name__ == "__main__":
    sys.exit(main())
