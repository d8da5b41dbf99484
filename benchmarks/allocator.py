"""The host allocator of CPU training processes: glibc's malloc against jemalloc, paired, on
layouts of the planner's table (its GPT on 4 processes, benchmarks/planner.py's worker: step
time, the slower rank's median; peak resident memory during ``fit`` above the size before).

Why: the planner predicts resident memory (issue 53), and under glibc what a process keeps
above its live tensors swings with the layout (60-133 MiB in results/planner_D.json) where under
jemalloc it stays within 49-72 MiB (results/planner_jemalloc.json). Whether meshtrain's CPU
workers should run on jemalloc depends on what it costs in speed: this measures both, each
allocator's runs in a process of their own (``LD_PRELOAD`` is read at process start), the
allocators alternated in every repeat so that load from other jobs hits both alike.

    python benchmarks/allocator.py [--repeats 3] [--out results/allocator.json]
    python benchmarks/allocator.py --fit results/planner.json   # the best allowance's bound

``--fit``: how close any allowance of the form tensors + a + b x (activations + transients) +
c x (gathered + transport buffers) could come to a planner run's resident peaks, fitted by
least squares on the judged rows themselves (so a bound: an allowance measured elsewhere does
no better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from harness import machine, paired_ratio, table, write_json

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
LAYOUTS = {  # the planner's best variants of these layouts (results/planner.json)
    "dp=4 mb=4": {"layout": "dp=4", "micro_batch_size": 4},
    "zero3=4 mb=4": {"layout": "zero3=4", "micro_batch_size": 4},
    "cp=4 mb=16": {"layout": "cp=4", "micro_batch_size": 16},
    "tp=4 mb=16 sp": {"layout": "tp=4", "micro_batch_size": 16, "sequence_parallel": True},
    "pp=2,dp=2 mb=4 1f1b": {"layout": "pp=2,dp=2", "micro_batch_size": 4, "pp_schedule": "1f1b"},
}


def one_allocator(names: list[str], steps: int) -> None:
    """In a child process started with (or without) jemalloc: every layout once, one JSON line
    each."""
    import planner
    from meshtrain.launch.spawn import run_workers
    from meshtrain.plan.cluster import host_allocator

    for name in names:
        ranks = run_workers(planner.worker, planner.WORLD, (planner.MODEL, LAYOUTS[name], steps),
                            timeout=600, threads=1)
        print(json.dumps({"layout": name, "allocator": host_allocator(),
                          "step_s": max(r["step_s"] for r in ranks),
                          "rss": max(r["peak"] for r in ranks)}), flush=True)


def run(allocator: str, names: list[str], steps: int) -> dict[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if allocator == "jemalloc":
        env["LD_PRELOAD"] = JEMALLOC
    out = subprocess.run([sys.executable, __file__, "--one", *names, "--steps", str(steps)],
                         env=env, capture_output=True, text=True, timeout=1800,
                         cwd=Path(__file__).parent)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert all(r["allocator"] == allocator for r in rows), (allocator, rows)
    return {r["layout"]: r for r in rows}


def fit(path: str) -> None:
    import numpy as np

    rows = json.loads(Path(path).read_text())["rows"]
    terms, above, rss = [], [], []
    for row in rows:
        m, measured = row["predicted_memory"], row["measured"]
        terms.append([1.0, m["activations"] + m["transient"], m["gathered"] + m["transport"]])
        above.append(measured["rss"] - measured["peak"])  # resident beyond live tensors
        rss.append(measured["rss"])
    a, y, rss = np.array(terms), np.array(above, dtype=float), np.array(rss, dtype=float)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    short = (y - a @ coef) / rss * 100
    print(f"{path}: a={coef[0] / 2**20:.1f} MiB b={coef[1]:.2f} c={coef[2]:.2f}: under by at "
          f"most {max(short.max(), 0):.1f} %, mean error {np.abs(short).mean():.1f} % "
          f"({len(rows)} layouts)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/allocator.json"))
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--fit", nargs="+", metavar="PLANNER_JSON")
    args = parser.parse_args(argv)
    if args.fit:
        for path in args.fit:
            fit(path)
        return 0
    if args.one:
        one_allocator(args.one, args.steps)
        return 0
    if not Path(JEMALLOC).is_file():
        print(f"{JEMALLOC} is missing: apt-get install libjemalloc2")
        return 2
    names, runs = list(LAYOUTS), {"glibc": [], "jemalloc": []}
    for rep in range(args.repeats):
        for allocator in runs:  # alternated: a, b, a, b, ...
            runs[allocator].append(run(allocator, names, args.steps))
            print(f"repeat {rep + 1}/{args.repeats} {allocator}: " + ", ".join(
                f"{n} {r['step_s']:.3f} s {r['rss'] / 2**20:.0f} MiB"
                for n, r in runs[allocator][-1].items()), flush=True)
    rows = {}
    for name in names:
        glibc = [r[name] for r in runs["glibc"]]
        jemalloc = [r[name] for r in runs["jemalloc"]]
        rows[name] = {
            "step_s": {a: [r["step_s"] for r in rs] for a, rs in (("glibc", glibc),
                                                                  ("jemalloc", jemalloc))},
            "rss_mib": {a: [r["rss"] / 2**20 for r in rs] for a, rs in (("glibc", glibc),
                                                                       ("jemalloc", jemalloc))},
        }
        rows[name]["step_ratio"] = paired_ratio(rows[name]["step_s"]["jemalloc"],
                                                rows[name]["step_s"]["glibc"])
        rows[name]["rss_ratio"] = paired_ratio(rows[name]["rss_mib"]["jemalloc"],
                                               rows[name]["rss_mib"]["glibc"])
    print(table(["layout", "step glibc s", "step jemalloc s", "jemalloc/glibc", "RSS glibc MiB",
                 "RSS jemalloc MiB", "jemalloc/glibc"],
                [[n, f"{statistics.median(r['step_s']['glibc']):.3f}",
                  f"{statistics.median(r['step_s']['jemalloc']):.3f}", f"{r['step_ratio']:.2f}",
                  "/".join(f"{v:.0f}" for v in r["rss_mib"]["glibc"]),
                  "/".join(f"{v:.0f}" for v in r["rss_mib"]["jemalloc"]),
                  f"{r['rss_ratio']:.2f}"] for n, r in rows.items()]))
    write_json(args.out, {"machine": machine(), "model": "benchmarks/planner.py MODEL",
                          "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
