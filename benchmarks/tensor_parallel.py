"""Tensor-parallel communication per step (against Megatron's count) and step time, tp=2.

On 2 processes (gloo, CPU, one torch thread per rank) a GPT with L = 1, 2 and 4 blocks is split
by ``meshtrain.parallel.tensor.tensor_parallel.apply_tp`` in three variants:

* ``tp``: Megatron tensor parallel: q/k/v and fc_in column-parallel, wo and fc_out row-parallel,
  vocab-parallel embedding and head (logits all-gathered over the vocabulary);
* ``tp+sp``: with sequence parallel (norms and the residual stream sharded on the sequence);
* ``tp+lp``: ``tp`` with ``loss_parallel`` (cross-entropy on the vocab-sharded logits).

The mesh is built as the Trainer builds it (``ParallelMesh``, ``local_comm="auto"``: on CPU
processes of one host the tp axis's collectives go through shared memory,
``meshtrain/parallel/shm/collectives.py``); ``tp gloo`` and ``tp+sp gloo`` run the same on the
axis's gloo group (``local_comm="backend"``), for step time only.

Communication: ``comm_counts`` counts the collectives one rank issues in one forward + backward
of one micro-batch, by kind and phase (DTensor's ``CommDebugMode``). Megatron (Shoeybi et al.
2019) needs 4 all-reduces per block per micro-batch without sequence parallel (2 forward, after
wo and fc_out; 2 backward, for the input gradients of q/k/v and fc_in); with it (Korthikanti et
al. 2022) each becomes a reduce-scatter + an all-gather: 4 all-gathers + 4 reduce-scatters per
block, and the norm weights' partial gradients summed once per optimizer step (Megatron-LM's
``finalize_model_grads``): meshtrain's ``complete_partial_grads``, counted as "step". The
per-block count is measured as the slope (count(L=4) - count(L=1)) / 3; the rest is what the
embedding, the head and the loss add once per micro-batch (and the step once per step).

Step time: forward + backward + AdamW step + zero_grad on the same batch for ``1proc`` (the
unsplit model on rank 0 alone, while rank 1 waits in a barrier, in the same processes) and for
each variant on 2 ranks (both ranks see the same batch, as a TP group must). Repeats are
interleaved; the table shows medians and the median of the per-repeat ratios to 1proc and to
plain tp on the same transport ("x tp": sequence parallel's goal is <= 1.05). Last,
3 steps of each at the largest L run under ``torch.profiler``: rank 0's time per step split into
matrix multiplies, collectives (issuing and waiting) and the rest; and one activation's
all-reduce, all-gather and reduce-scatter are timed on both groups, for scale.

    python benchmarks/tensor_parallel.py            # 2 warm-up + 10 timed steps, 5 repeats
    python benchmarks/tensor_parallel.py --quick    # smoke run
    python benchmarks/tensor_parallel.py --from-json benchmarks/results/tensor_parallel.json
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
    WallClock, end_process_group, hang_guard, in_ms, init_gloo, machine, mean_time,
    median_time, paired_ratio, slower_rank, table, write_json,
)

from meshtrain.launch.spawn import run_workers

TP = 2
VARIANTS = {"tp": {}, "tp+sp": {"sequence_parallel": True}, "tp+lp": {"loss_parallel": True}}
# the same on the tp axis's gloo group (local_comm="backend"): step time only (same counts)
GLOO_VARIANTS = {f"{name} gloo": options for name, options in VARIANTS.items()
                 if name != "tp+lp"}
# sequence parallel on the shared-memory group through DTensor's own redistribution
# (sequence_parallel.DTENSOR_REDISTRIBUTE) instead of meshtrain's two autograd functions, which
# run there only (on gloo, "tp+sp gloo", DTensor's redistribution runs): step time only
DTENSOR_VARIANTS = {"tp+sp dtensor": {"sequence_parallel": True}}
ALL_VARIANTS = {**VARIANTS, **GLOO_VARIANTS, **DTENSOR_VARIANTS}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Config:
    steps: int = 10  # timed steps per case and repeat
    warmup: int = 2
    batch_size: int = 8
    seq_len: int = 64
    d_model: int = 256
    num_heads: int = 4
    vocab_size: int = 256
    layers: tuple[int, ...] = (1, 2, 4)
    lr: float = 1e-3
    seed: int = 0

    def gpt_config(self, num_layers: int):
        from meshtrain.models.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, num_layers=num_layers,
                         num_heads=self.num_heads, d_model=self.d_model)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def megatron(variant: str) -> dict[str, int]:
    """Collectives per block per micro-batch in Megatron-LM."""
    if variant == "tp+sp":
        return {"forward/all_gather": 2, "forward/reduce_scatter": 2,
                "backward/all_gather": 2, "backward/reduce_scatter": 2}
    return {"forward/all_reduce": 2, "backward/all_reduce": 2}


# -------------------------------------------------------------------------------------------------
# the run (on every rank)
# -------------------------------------------------------------------------------------------------
def tp_worker(cfg: Config, repeats: int, hang_s: float) -> dict:
    with hang_guard(hang_s):
        return _tp_cases(cfg, repeats, init_gloo(hang_s))


def _tp_cases(cfg: Config, repeats: int, rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.models.gpt import GPT
    from meshtrain.parallel.tensor.tensor_parallel import (
        apply_tp, complete_partial_grads, loss_parallel_context,
    )
    from meshtrain.parallel.tensor.tp_debug import comm_counts

    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh

    # as the Trainer builds it (local_comm="auto": the tp axis's collectives in shared memory)
    mesh = ParallelMesh(Layout.parse(f"tp={TP}", TP), "cpu").mesh
    gloo_mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    transport = dist.get_backend(mesh.get_group("tp"))
    gen = torch.Generator().manual_seed(1234)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=gen)

    models = {}
    counts = {}
    for layers in cfg.layers:
        for variant, options in ALL_VARIANTS.items():
            # as the Trainer: partial gradients (norms under sp) summed once per step
            model = apply_tp(GPT(cfg.gpt_config(layers), seed=cfg.seed),
                             gloo_mesh if variant in GLOO_VARIANTS else mesh, **options,
                             grads_per_step=True)
            lp = options.get("loss_parallel", False)
            if variant in VARIANTS:
                count = comm_counts(model, (x, y), lm_loss, loss_parallel=lp)
                count["step/all_reduce"] = complete_partial_grads(model.parameters())
                counts[f"{variant} L={layers}"] = count
                model.zero_grad(set_to_none=True)
            models[variant, layers] = model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), lp
        if rank == 0:
            model = GPT(cfg.gpt_config(layers), seed=cfg.seed)
            models["1proc", layers] = model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), False

    # gloo's cost of one all-reduce of an activation (batch x seq x d_model fp32), and of 1
    # float; and of the all-gather and reduce-scatter sequence parallel uses in its place
    latency = {}  # (torch 2.13's names; older ones have the *_tensor ones alone)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    act = torch.randn(cfg.batch_size * cfg.seq_len * cfg.d_model)
    half, one = torch.empty(act.numel() // TP), torch.ones(1)
    for name, group in ((transport, mesh.get_group("tp")), ("gloo", gloo_mesh.get_group("tp"))):
        for label, run in (
                ("activation all-reduce", lambda: dist.all_reduce(act, group=group)),
                ("1-float all-reduce", lambda: dist.all_reduce(one, group=group)),
                ("activation all-gather", lambda: all_gather(act, half, group=group)),
                ("activation reduce-scatter", lambda: reduce_scatter(half, act, group=group))):
            latency[f"{name} {label}"] = 1e3 * median_time(run, before=dist.barrier)

    opt_s = [0.0]  # time in optimizer.step + zero_grad, summed
    dtensor_models = [models[v, n][0] for v, n in models if v in DTENSOR_VARIANTS]

    from meshtrain.parallel.tensor import sequence_parallel

    def train_step(model, opt, lp):
        sequence_parallel.DTENSOR_REDISTRIBUTE = model in dtensor_models
        with loss_parallel_context(lp):
            lm_loss(model(x), y).backward()
        sequence_parallel.DTENSOR_REDISTRIBUTE = False
        complete_partial_grads(model.parameters())
        start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_s[0] += time.perf_counter() - start

    def timed(step, n: int) -> tuple[float, float]:
        opt_s[0] = 0.0
        return mean_time(step, n), opt_s[0] / n

    step_s: dict[str, list[float]] = {}
    optim_s: dict[str, list[float]] = {}
    for _ in range(repeats):
        for layers in cfg.layers:
            for variant in ("1proc", *ALL_VARIANTS):
                dist.barrier()
                if variant == "1proc" and rank != 0:  # rank 0 runs it alone; rank 1 waits
                    continue
                model, opt, lp = models[variant, layers]
                timed(lambda: train_step(model, opt, lp), cfg.warmup)
                step, optim = timed(lambda: train_step(model, opt, lp), cfg.steps)
                step_s.setdefault(f"{variant} L={layers}", []).append(step)
                optim_s.setdefault(f"{variant} L={layers}", []).append(optim)
    # Where the time goes, at the largest L: torch.profiler over a few steps (rank 0's view)
    profile = {}
    layers = max(cfg.layers)
    for variant in ("1proc", *ALL_VARIANTS):
        dist.barrier()
        if variant == "1proc" and rank != 0:
            continue
        model, opt, lp = models[variant, layers]
        profile[f"{variant} L={layers}"] = profile_steps(lambda: train_step(model, opt, lp), 3)
    end_process_group()  # while the models are alive
    return {"rank": rank, "counts": counts, "step_s": step_s, "optim_s": optim_s,
            "all_reduce_ms": latency, "profile": profile, "transport": transport}


def profile_steps(step, n: int) -> dict[str, float]:
    """ms per step, by operator self time: matrix multiplies, collectives (issuing them and
    waiting for them: ``wait_tensor`` blocks until the other rank has joined and gloo is done),
    and everything else (DTensor dispatch, element-wise ops, autograd, AdamW; the profiler's
    own overhead lands here too), beside the wall-clock time."""
    from torch.profiler import ProfilerActivity, profile

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the profiler's C++ side logs every start and stop on stderr
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(n):
                step()
            wall = time.perf_counter() - start
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    parts = {"matmul": 0.0, "collectives": 0.0, "other": 0.0}
    for event in prof.key_averages():
        if event.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            part = "matmul"
        elif event.key.startswith(("c10d::", "_c10d_functional::", "c10d_functional::",
                                   "meshtrain_shm::")):  # sequence parallel's own exchanges
            part = "collectives"
        else:
            part = "other"
        parts[part] += event.self_cpu_time_total / 1e3 / n  # µs in total -> ms per step
    return {"wall": 1e3 * wall / n, **parts}


# -------------------------------------------------------------------------------------------------
# summary and tables
# -------------------------------------------------------------------------------------------------
def summarize(cfg: Config, ranks: list[dict]) -> dict:
    counts = ranks[0]["counts"]
    assert all(r["counts"] == counts for r in ranks), "ranks issued different collectives"
    lo, hi = min(cfg.layers), max(cfg.layers)
    comm = {}
    for variant in VARIANTS:
        rows = {layers: counts[f"{variant} L={layers}"] for layers in cfg.layers}
        keys = sorted({k for row in rows.values() for k in row if "/" in k})
        per_block = {k: (rows[hi].get(k, 0) - rows[lo].get(k, 0)) / (hi - lo) for k in keys}
        constant = {k: rows[lo].get(k, 0) - per_block[k] * lo for k in keys}
        comm[variant] = {"counts": {str(n): row for n, row in rows.items()},
                         "per_block": per_block, "outside_blocks": constant,
                         "megatron_per_block": megatron(variant)}
    step_s = slower_rank(ranks, "step_s")  # 1proc ran on rank 0 only
    timing = {}
    for layers in cfg.layers:
        base = step_s[f"1proc L={layers}"]
        for variant in ("1proc", *ALL_VARIANTS):
            times = step_s[f"{variant} L={layers}"]
            name = f"{variant} L={layers}"
            # against plain tp on the same transport (sequence parallel's goal: <= 1.05)
            tp = "tp gloo" if variant in GLOO_VARIANTS else "tp"
            timing[name] = {
                "variant": variant, "layers": layers, **in_ms(times),
                # AdamW step + zero_grad, rank 0 (the ranks hold equal halves)
                "optim_ms": 1e3 * statistics.median(ranks[0]["optim_s"][name]),
                "x_1proc": paired_ratio(times, base),
                "x_tp": (paired_ratio(times, step_s[f"{tp} L={layers}"])
                         if variant != "1proc" else None),
            }
    # sequence parallel through DTensor's redistribution over meshtrain's own functions
    dtensor = {f"{own} L={n}": paired_ratio(step_s[f"{v} L={n}"], step_s[f"{own} L={n}"])
               for n in cfg.layers
               for v, own in (("tp+sp dtensor", "tp+sp"),)}
    return {"comm": comm, "timing": timing, "dtensor_over_own": dtensor,
            "all_reduce_ms": ranks[0]["all_reduce_ms"],
            "profile": ranks[0]["profile"], "transport": ranks[0]["transport"]}


def _n(value: float) -> str:
    return f"{value:g}"


def format_tables(summary: dict) -> str:
    columns = [f"{phase}/{kind}" for kind in KINDS for phase in ("forward", "backward")]
    columns.append("step/all_reduce")  # once per optimizer step, not per micro-batch
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    header = ["variant", "L", *(f"{c.split('/')[0][:3]} {short[c.split('/')[1]]}" for c in
                                columns), "total"]
    rows = []
    for variant, data in summary["comm"].items():
        for layers, row in data["counts"].items():
            rows.append((variant, layers, *(_n(row.get(c, 0)) for c in columns),
                         _n(sum(row.get(c, 0) for c in columns))))
        for label, row in (("per block", data["per_block"]),
                           ("Megatron/block", data["megatron_per_block"]),
                           ("outside blocks", data["outside_blocks"])):
            rows.append((f"  {label}", "", *(_n(row.get(c, 0)) for c in columns),
                         _n(sum(row.get(c, 0) for c in columns))))
    comm = table(header, rows)
    timing_rows = [(r["variant"], str(r["layers"]), f"{r['median_ms']:.1f}",
                    f"{min(r['repeats_ms']):.1f}", f"{max(r['repeats_ms']):.1f}",
                    f"{r['x_1proc']:.3f}",
                    "" if r.get("x_tp") is None else f"{r['x_tp']:.3f}",
                    f"{r['optim_ms']:.1f}", f"{r['median_ms'] - r['optim_ms']:.1f}")
                   for r in summary["timing"].values()]
    timing = table(("variant", "L", "median ms/step", "min", "max", "x 1proc (paired)",
                    "x tp (paired)", "optim ms", "fwd+bwd ms"), timing_rows)
    profile = table(("variant", "wall ms/step", "matmul", "collectives", "other"),
                     [(name, *(f"{row[k]:.1f}" for k in ("wall", "matmul", "collectives", "other")))
                      for name, row in summary["profile"].items()])
    if summary.get("dtensor_over_own"):
        timing += ("\n\nsequence parallel through DTensor's redistribution / through meshtrain's "
                   "functions, paired: " + ", ".join(
                       f"{k} {v:.3f}" for k, v in summary["dtensor_over_own"].items()))
    timing += "\n\nrank 0 under torch.profiler, ms per step by operator self time:\n" + profile
    latency = ", ".join(f"{k} {v:.2f} ms" for k, v in summary["all_reduce_ms"].items())
    transport = summary.get("transport", "gloo")
    return (f"{comm}\n(\"ste AR\": all-reduces once per optimizer step, whatever the number of "
            f"micro-batches)\n\n{timing}\n\n(tp axis: {transport}; \"gloo\" rows: its gloo "
            f"group)\ncollectives on 2 ranks (median): {latency}")


# -------------------------------------------------------------------------------------------------
# driver
# -------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case (10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (5)")
    parser.add_argument("--d-model", type=int, default=256, help="GPT width (256)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: d_model 64, 1 warm-up + 2 timed steps, 1 repeat")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a hung run is killed")
    parser.add_argument("--out-dir", default="benchmarks/results",
                        help="where tensor_parallel.json goes")
    parser.add_argument("--from-json", help="only print the tables of a tensor_parallel.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.d_model = 2, 1, 1, 64
    if min(args.steps, args.warmup, args.repeats) < 1:
        parser.error("--steps, --warmup and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(format_tables(json.loads(Path(args.from_json).read_text())["summary"]))
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = Config(steps=args.steps, warmup=args.warmup, d_model=args.d_model)
    title = (f"tp={TP} (gloo, CPU, 1 thread per rank), GPT d={cfg.d_model} heads={cfg.num_heads} "
             f"seq={cfg.seq_len} vocab={cfg.vocab_size}, L in {list(cfg.layers)}, batch "
             f"{cfg.batch_size}")
    print(f"tensor-parallel benchmark: {title}; {cfg.warmup} warm-up + {cfg.steps} timed steps, "
          f"{args.repeats} repeats, torch {torch.__version__}", flush=True)
    clock = WallClock()
    ranks = run_workers(tp_worker, TP, (cfg, args.repeats, max(1.0, args.timeout - 10)),
                        timeout=args.timeout, threads=1)
    print(f"({clock.stop()})\n")
    summary = summarize(cfg, ranks)
    print(format_tables(summary))
    result = {
        "title": title,
        "config": asdict(cfg) | {"tp": TP},
        "repeats": args.repeats,
        "machine": machine(**clock.loads()),
        "summary": summary,
    }
    print(f"\nwrote {write_json(Path(args.out_dir) / 'tensor_parallel.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
