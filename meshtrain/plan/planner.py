"""``meshtrain plan``: every legal layout of a model on a cluster, estimated and ranked, and for
each rejected one the reason.

    meshtrain plan examples/llama3/70b.json --cluster 8xH100 --nodes 32 \\
        --global-batch 2048 --seq-len 8192 [--top 10] [--json FILE|-] [--pin tp=8]

Candidates: every factoring of the world into pp x (dp | zero1 | zero2 | zero3 | HSDP) x cp x tp
with tp inside a node and dividing the (key/value) heads, cp splitting the sequence into 2 x cp
chunks (tp x cp inside a node: their collectives run every block), pp with 1F1B and interleaved 1F1B (2 stages per rank); each with micro-batches of
1, 2, 4, ... samples and activation checkpointing off, selective and full; sequence parallel
where the model takes it. Ranked by estimated step time among those that fit in memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout
from meshtrain.plan.cluster import Cluster, gib
from meshtrain.plan.candidate import Candidate, Estimate, Job
from meshtrain.plan.estimate import Estimator
from meshtrain.plan.model_spec import ModelSpec


@dataclasses.dataclass
class Plan:
    rows: list[Estimate]  # fitting, fastest first
    rejected: list[tuple[str, str]]  # (candidate, reason)
    too_big: list[Estimate]  # estimated, but over the device memory
    seconds: float
    num_params: int

    @property
    def pick(self) -> Estimate:
        if not self.rows:
            raise ConfigError(self.nothing_fits())
        return self.rows[0]

    def nothing_fits(self) -> str:
        if self.too_big:
            smallest = min(self.too_big, key=lambda e: e.memory_total)
            return (f"no layout fits: the smallest, {smallest.candidate}, needs "
                    f"{gib(smallest.memory_total)} GiB per device; use more devices or nodes, "
                    "devices with more memory, or a shorter sequence")
        reasons = sorted({r for _, r in self.rejected})
        return "no layout is legal for this job: " + "; ".join(reasons[:4])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_axes(degree: int, inner: int, devices_per_node: int) -> list[str]:
    """The data-parallel parts of a layout for ``degree`` ranks (``inner``: tp x cp)."""
    if degree == 1:
        return [""]
    forms = [f"dp={degree}", f"zero1={degree}", f"zero2={degree}", f"zero3={degree}"]
    for shard in divisors(degree)[1:-1]:  # HSDP: shards within a node, replicas across
        if shard * inner == devices_per_node:
            forms.append(f"dp_replicate={degree // shard},dp_shard={shard}")
    return forms


def candidates(spec: ModelSpec, cluster: Cluster, job: Job, pins: dict | None = None,
               fixed: dict | None = None):
    """Yield (Candidate, None) or (description, reason) for every combination considered.
    ``pins``: axis degrees; ``fixed``: Trainer settings every candidate takes (micro_batch_size,
    activation_checkpointing, sequence_parallel, pp_schedule, stages_per_rank; a pipeline
    setting asks for a pipeline)."""
    pins, fixed = pins or {}, fixed or {}
    world, dpn = cluster.world_size, cluster.devices_per_node
    for tp in divisors(world):
        if tp > 1 and tp > dpn:
            yield f"tp={tp}", f"tp={tp} would cross nodes ({dpn} devices per node)"
            continue
        if tp > 1 and spec.refuses("tp"):
            yield f"tp={tp}", spec.refuses("tp")
            continue
        if tp > 1 and spec.num_experts and spec.is_hf:  # (meshtrain's MoE GPT: by hidden unit)
            yield f"tp={tp}", (f"tp={tp}: meshtrain does not split a Hugging Face model's "
                               f"experts by tensor parallel ({spec.num_experts} a layer)")
            continue
        if spec.num_heads % tp or spec.num_kv_heads % tp:
            yield f"tp={tp}", (f"tp={tp} does not divide the {spec.num_heads} heads / "
                               f"{spec.num_kv_heads} key-value heads")
            continue
        for cp in divisors(world // tp):
            if cp > 1 and cp * tp > dpn:
                yield f"cp={cp},tp={tp}", (f"cp x tp = {cp * tp} would cross nodes ({dpn} "
                                           "devices per node)")
                continue
            if cp > 1 and spec.refuses("cp"):
                yield f"cp={cp}", spec.refuses("cp")
                continue
            if cp > 1 and job.seq_len % (2 * cp):
                yield f"cp={cp}", f"seq_len {job.seq_len} does not split into 2 x cp={cp} chunks"
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > 1 and cp > 1:
                    continue  # not planned yet (it trains: tests/parallel/test_cp_pp.py)
                if pp > 1 and spec.refuses("pp"):
                    yield f"pp={pp}", spec.refuses("pp")
                    continue
                if pp > 1 and spec.balances_routers:
                    yield f"pp={pp}", (f"pp={pp}: meshtrain balances the routers over each "
                                       "micro-step's global batch, which a pipeline splits")
                    continue
                if pp > spec.num_layers // 2 and pp > 1:
                    yield f"pp={pp}", f"pp={pp} leaves fewer than 2 of {spec.num_layers} blocks per stage"
                    continue
                dp = world // (tp * cp * pp)
                for data in _data_axes(dp, tp * cp, dpn):
                    if data.startswith("zero1") and (pp > 1 or tp > 1 or cp > 1):
                        continue  # zero1 is for plain data parallelism only
                    layout = ",".join(p for p in (f"pp={pp}" if pp > 1 else "", data,
                                                  f"cp={cp}" if cp > 1 else "",
                                                  f"tp={tp}" if tp > 1 else "") if p) or "dp=1"
                    for layout in (layout, *_expert_layouts(spec, layout, dp * cp, data)):
                        if not _pinned(layout, world, pins):
                            continue
                        yield from _variants(spec, job, layout, dp, pp, tp, fixed)


def _expert_layouts(spec: ModelSpec, layout: str, borrowed: int, data: str) -> list[str]:
    """``layout`` with ``ep`` for an MoE model: every degree that divides both the data- and
    context-parallel ranks it borrows and the experts (not with zero1 or tp: refused)."""
    if not spec.num_experts or data.startswith("zero1") or "tp=" in layout:
        return []
    return [f"{layout},ep={ep}" for ep in divisors(borrowed)[1:] if spec.num_experts % ep == 0]


def _variants(spec, job, layout, dp, pp, tp, fixed):
    if job.global_batch % dp:
        yield layout, f"global batch {job.global_batch} does not split over {dp} data-parallel ranks"
        return
    per_rank = job.global_batch // dp
    schedules = [("1f1b", 1)]
    if pp > 1 and spec.num_layers >= 4 * pp:
        schedules.append(("interleaved-1f1b", 2))
    if {"pp_schedule", "stages_per_rank"} & set(fixed):
        if pp == 1:
            return  # a pipeline setting asks for a pipeline
        schedules = [(fixed.get("pp_schedule", "1f1b"), fixed.get("stages_per_rank", 1))]
    batches = (1, 2, 4, 8, 16, 32)
    if "micro_batch_size" in fixed:
        batches = (fixed["micro_batch_size"],)
        if per_rank % batches[0]:
            yield layout, (f"micro_batch_size={batches[0]} does not divide the {per_rank} "
                           f"samples per data-parallel rank")
            return
    checkpointing = (fixed["activation_checkpointing"],) if "activation_checkpointing" in fixed \
        else (None, "selective", "full")
    parallel = (False, True) if tp > 1 and not spec.is_hf else (False,)
    if "sequence_parallel" in fixed:
        if fixed["sequence_parallel"] and tp == 1:
            return  # sequence parallelism asks for tensor parallelism
        parallel = (fixed["sequence_parallel"],)
    for mb in (b for b in batches if per_rank % b == 0):
        if pp > 1 and per_rank // mb < pp and "micro_batch_size" not in fixed:
            continue  # fewer micro-batches than stages: mostly bubble
        for ac in checkpointing:
            for sp in parallel:
                for schedule, v in schedules:
                    if v > 1 and (per_rank // mb) % pp:
                        continue
                    yield Candidate(layout, mb, ac, sp, schedule, v), None


def _pinned(layout: str, world: int, pins: dict) -> bool:
    parsed = Layout.parse(layout, world)
    for axis, degree in pins.items():
        if axis in ("zero1", "zero2", "zero3"):
            if parsed.zero_stage != int(axis[-1]) or parsed.degree(
                    "dp" if axis == "zero1" else "dp_shard") != degree:
                return False
        elif (parsed.expert_degree if axis == "ep" else parsed.degree(axis)) != degree:
            return False
    return True


def _pinned_ranks(pins: dict) -> int:
    """The processes the pinned degrees need: ``ep`` borrows data-parallel ranks and adds
    none (alone it needs ``ep`` of them)."""
    ranks = math.prod(d for a, d in pins.items() if a != "ep")
    borrowed = {"dp", "dp_shard", "dp_replicate", "cp", "zero1", "zero2", "zero3"}
    return ranks * pins["ep"] if "ep" in pins and not borrowed & set(pins) else ranks


def plan(spec: ModelSpec, cluster: Cluster, job: Job, *, pins: dict | None = None,
         fixed: dict | None = None, estimator: Estimator | None = None) -> Plan:
    start = time.perf_counter()
    if job.seq_len > spec.max_seq_len:
        raise ConfigError(f"seq_len {job.seq_len} is above the model's maximum "
                          f"{spec.max_seq_len}; use a shorter sequence")
    estimator = estimator or Estimator(spec, cluster, job)
    rows, rejected, too_big = [], [], []
    for candidate, reason in candidates(spec, cluster, job, pins, fixed):
        if reason:
            rejected.append((candidate, reason))
            continue
        estimate = estimator.estimate(candidate)
        (rows if estimate.memory_total <= cluster.memory else too_big).append(estimate)
    if pins and not rows and not too_big:
        pinned = ",".join(f"{a}={d}" for a, d in pins.items())
        why = (f"{pinned} does not divide {cluster.world_size} devices"
               if cluster.world_size % _pinned_ranks(pins) else
               "; ".join(sorted({r for _, r in rejected})[:3]) or "no candidate matched")
        raise ConfigError(f"no layout of {cluster.world_size} devices has {pinned} for this job "
                          f"({why}); change the pinned degrees or the number of devices")
    rows.sort(key=lambda e: (e.step_seconds, e.memory_total))
    return Plan(rows, rejected, too_big, time.perf_counter() - start,
                estimator.sizes.num_params)


def table(result: Plan, cluster: Cluster, top: int) -> str:
    """The top rows' estimates by part ("bubble": a pipeline's idle slots and, sharing cores,
    the cores it leaves idle besides)."""
    experts = any(e.seconds.get("ep_comm") for e in result.rows[:top])  # an ep column then
    lines = [f"{'#':>3}  {'layout':<46} {'GiB/dev':>8} {'step s':>9} {'compute':>8} "
             f"{'bubble':>7} {'tp/cp':>7} {'dp':>7}" + (f" {'ep':>7}" if experts else "")]
    for i, e in enumerate(result.rows[:top], 1):
        s = e.seconds
        lines.append(f"{i:>3}  {str(e.candidate):<46} {gib(e.memory_total):>8} "
                     f"{e.step_seconds:>9.3f} {s['compute']:>8.3f} "
                     f"{s['bubble'] + s.get('pp_idle', 0.0):>7.3f} "
                     f"{s['tp_cp_comm']:>7.3f} {s['dp_comm_exposed']:>7.3f}"
                     + (f" {s['ep_comm']:>7.3f}" if experts else ""))
    by_reason: dict[str, int] = {}
    for _, reason in result.rejected:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    lines.append(f"\n{len(result.rows)} fit, {len(result.too_big)} do not fit in "
                 f"{gib(cluster.memory)} GiB per device, {len(result.rejected)} refused "
                 f"({result.seconds:.1f} s)" + (":" if by_reason or result.too_big else ""))
    if result.too_big:
        best = min(result.too_big, key=lambda e: e.step_seconds)
        lines.append(f"  does not fit: e.g. {best.candidate} needs {gib(best.memory_total)} GiB")
    for reason, count in sorted(by_reason.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"  {count} x {reason}")
    return "\n".join(lines)


def as_json(result: Plan, spec: ModelSpec, cluster: Cluster, job: Job) -> dict:
    def row(e: Estimate) -> dict:
        return {"candidate": str(e.candidate), "settings": e.candidate.settings(),
                "accumulation": e.accumulation, "memory_bytes": e.memory,
                "memory_total": e.memory_total, "seconds": e.seconds,
                "step_seconds": e.step_seconds}
    return {"model": spec.name, "num_params": result.num_params,
            "cluster": dataclasses.asdict(cluster) | {"comm_table": None},
            "job": dataclasses.asdict(job), "seconds": result.seconds,
            "rows": [row(e) for e in result.rows],
            "too_big": [row(e) for e in result.too_big],
            "rejected": [{"candidate": c, "reason": r} for c, r in result.rejected]}


def parse_pins(text: str | None) -> dict:
    if not text:
        return {}
    pins = {}
    for part in text.split(","):
        axis, _, degree = part.partition("=")
        if not degree.strip().isdigit():
            raise ConfigError(f"--pin {text!r}: write axis=degree pairs, e.g. tp=8,pp=4")
        pins[axis.strip()] = int(degree)
    check = dict(pins)  # (pins are part of a layout: HSDP's shard degree may be the planner's)
    if "dp_replicate" in check and not {"dp_shard", "zero2", "zero3"} & set(check):
        check["dp_shard"] = 2
    Layout.parse(",".join(f"{a}={d}" for a, d in check.items()), _pinned_ranks(check))
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshtrain plan", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a config.json, a meshtrain .toml job, or "
                        "family:key=value,... (gpt:..., llama:...)")
    parser.add_argument("--cluster", default="8xH100",
                        help="8xH100, 8xH200 or this-machine (default 8xH100)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, help="this-machine: the processes")
    parser.add_argument("--comm", help="this-machine: a `meshtrain bench comm --json` file")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--pin", help="degrees the layout must have, e.g. tp=8")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", help="write the whole plan as JSON to FILE (- for stdout)")
    parser.add_argument("--build", action="store_true",
                        help="build the pick for real in this process (a simulated world of "
                        "its size) and compare each pipeline end's model state with the estimate")
    args = parser.parse_args(argv)
    spec = ModelSpec.load(args.model)
    cluster = Cluster.preset(args.cluster, nodes=args.nodes, comm=args.comm,
                             processes=args.devices)
    job = Job(args.global_batch, args.seq_len)
    estimator = Estimator(spec, cluster, job)
    result = plan(spec, cluster, job, pins=parse_pins(args.pin), estimator=estimator)
    if args.json == "-":
        json.dump(as_json(result, spec, cluster, Job(args.global_batch, args.seq_len)),
                  sys.stdout, indent=1)
        return 0 if result.rows else 1
    print(f"{spec.name}: {result.num_params / 1e9:.2f}B parameters on {cluster.nodes} x "
          f"{cluster.devices_per_node} ({cluster.peak_note}); global batch "
          f"{args.global_batch} x {args.seq_len} tokens")
    print(table(result, cluster, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(result, spec, cluster, Job(args.global_batch, args.seq_len)), f,
                      indent=1)
    if not result.rows:
        print(f"error: {result.nothing_fits()}", file=sys.stderr)
        return 1
    if args.build:
        print("\n" + "\n".join(build_pick(spec, estimator, result.pick)))
    return 0


def build_pick(spec: ModelSpec, estimator: Estimator, pick: Estimate) -> list[str]:
    """The pick built for real (meshtrain.plan.simulate) on the first rank of its first and
    last pipeline stage: the model state stored there against the estimate's."""
    from meshtrain.plan.simulate import simulate

    c = pick.candidate
    layout = Layout.parse(c.layout, estimator.cluster.world_size)
    pp = layout.degree("pp")
    lines = [f"built {c.layout} at world size {layout.world_size} (a simulated world):"]
    for pp_rank, estimated in sorted(pick.model_state_rank.items()):
        rank = pp_rank * (layout.world_size // pp)
        built = simulate(spec.factory(), layout, rank=rank,
                         pipeline=estimator.pipeline(c.stages_per_rank, c.pp_schedule))
        verdict = "equal" if built.total == estimated else f"estimate off by {estimated - built.total:+,} B"
        lines.append(f"  rank {rank}: {built.local_params / 1e6:,.1f}M parameters, model state "
                     f"{gib(built.total)} GiB (estimated {gib(estimated)} GiB: {verdict}), "
                     f"built in {built.seconds:.1f} s")
        lines.append("    " + setup_line(built))
    return lines


def setup_line(built) -> str:
    """The set-up a rank of the pick goes through in the Trainer (the same choice)."""
    setup = built.setup
    if built.whole_build is not None:
        return (f"set-up: each rank builds the whole model first, {gib(setup.held)} GiB "
                f"({built.whole_build})")
    return (f"set-up: built on the meta device, the rank holds its shards, {gib(setup.held)} "
            f"GiB, and draws at most {gib(setup.staging)} GiB at once on the host "
            f"({setup.staging_module or 'the model'} whole; a CPU rank: "
            f"{gib(setup.peak)} GiB in all), against {gib(built.num_params * 4)} GiB for the "
            "whole model in fp32")


if __name__ == "__main__":
    sys.exit(main())
