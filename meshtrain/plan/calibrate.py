"""This machine's speed on the job's own model: a one-block copy of it run for real (forward and
backward, one CPU thread) in a simulated tp x cp world and timed, so the estimate's compute
carries what a matmul probe does not see: the elementwise operators, the loss, and the host
cost of every operator (DTensor's dispatch under tp, the sequence chunks under cp).

    rate = achieved_flops(spec, tp=2, cp=1, sequence_parallel=False, seq_len=128, micro_batch=4)
    seconds = flops / (rate * cluster.compute_share)

The simulated world's collectives move nothing: their cost is the communication part of the
estimate (a ``meshtrain bench comm`` table). Models whose one block is too large to run here
return None (the estimate then uses the matmul probe). :func:`sharding_host_seconds` measures
the same way what FSDP2's own work (its hooks, the copies into and out of the gathered
buffers, the optimizer on DTensor shards) adds to a step of the whole model.
"""

from __future__ import annotations

import functools
import time
import warnings

import torch

from meshtrain.parallel.layout import Layout
from meshtrain.plan.probe import probe_model
from meshtrain.plan.simulate import default_options, fake_world, this_ranks_modules

#: the largest one-block model run for real (parameters)
MAX_PARAMS = 50_000_000


def achieved_flops(spec, *, tp: int, cp: int, sequence_parallel: bool, seq_len: int,
                   micro_batch: int) -> float | None:
    """FLOP/s one thread reaches on a micro-batch of ``spec``'s model (one block, its
    embedding, head and loss) on one rank of a ``tp`` x ``cp`` group; None if too large to
    run here. A micro-batch costs a fixed host part plus a part per sample, both measured."""
    timing = _timing(spec, tp, cp, sequence_parallel, seq_len)
    if timing is None:
        return None
    fixed, per_sample, flops = timing
    return flops * micro_batch / (fixed + per_sample * micro_batch)


@functools.lru_cache(maxsize=64)
def _timing(spec, tp: int, cp: int, sequence_parallel: bool, seq_len: int,
            seconds: float = 0.3, builds: int = 5) -> tuple[float, float, int] | None:
    """(seconds per micro-batch, seconds per sample, FLOPs per sample) from runs at
    micro-batches of 1 and 16, timed by turns (the fastest of each, at least 3 rounds in
    ``seconds``) on each of ``builds`` fresh builds of the rank. One process's block (the
    reference) takes the build of median speed; a ``tp`` x ``cp`` rank is built and timed by
    turns with a fresh reference each time, and is the reference's time x the median of those
    ratios."""
    depth = None if spec.own else 1  # an own model runs whole, an LM with one block
    with torch.device("meta"):
        if sum(p.numel() for p in spec.build(depth).parameters()) > MAX_PARAMS:
            return None
    if spec.own:
        from meshtrain.plan.probe import probe_own

        probe = probe_own(spec)
    else:
        probe = probe_model(spec, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                            seq_len=seq_len)
    flops = probe.first.flops + probe.block.flops * (spec.num_layers if spec.own else 1) \
        + probe.last.flops
    layout = Layout.parse(",".join(f"{a}={d}" for a, d in (("cp", cp), ("tp", tp)) if d > 1)
                          or "dp=1", tp * cp)
    with _one_thread():
        # one build is a draw: whether the allocator hands the pass's large buffers back to
        # the system at its end (and faults them in again) is set by where the build left the
        # heap (tp=4 of the planner benchmark's GPT, a pass at 16 sequences over 8 builds in
        # a row: 0 to 8,160 page faults a pass, steady within a build; 86 ms without, 98-105
        # with, all of it in the loss's log-softmax and fills), so the median of a few
        reference = _reference(spec, depth, seq_len, seconds, builds)
        if not layout.degrees:
            many, one = reference
        else:
            # and this machine's speed moves from minute to minute (the reference 286-415 ms
            # a pass in five calibrations one after the other): each timed apart, tp=4 / one
            # process came out 0.48-0.54 and tp=2 0.62-0.81 in five fresh calibrations; by
            # turns, the median of 5 builds, 0.47-0.49 and 0.64-0.70 (benchmarks/README.md,
            # 2026-11-30: `planner.py --calibrations 5`)
            pairs = [_one_build(spec, layout, sequence_parallel, depth, seq_len, cp,
                                seconds / builds) for _ in range(builds)]
            many = reference[0] * _median([t[0] / r[0] for r, t in pairs])
            one = reference[1] * _median([t[1] / r[1] for r, t in pairs])
    # runs that do not order (a model so small that noise outweighs 15 samples) count as all
    # per sample
    per_sample = (many - one) / 15 if many > one else many / 16
    return max(0.0, one - per_sample), per_sample, flops


@functools.lru_cache(maxsize=16)
def _reference(spec, depth: int | None, seq_len: int, seconds: float,
               builds: int) -> tuple[float, float]:
    """(pass at 16 sequences, at 1) of one process's block: the build of median speed."""
    one_process = Layout.parse("dp=1", 1)
    runs = sorted(_one_build(spec, one_process, False, depth, seq_len, 1, seconds / builds)[0]
                  for _ in range(builds))
    return runs[len(runs) // 2]


class _one_thread:
    """One thread, denormals flushed (garbage values must not run at denormal speed)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_flush_denormal(True)
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)
        torch.set_flush_denormal(False)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _one_build(spec, layout: Layout, sequence_parallel: bool, depth: int | None, seq_len: int,
               cp: int, seconds: float) -> list[tuple[float, float]]:
    """[(fastest pass at 16 sequences, at 1)] of one fresh build of one process's block, then
    (``layout`` with degrees) of this rank's modules under ``layout`` (its sequence chunk of
    ``seq_len`` under ``cp``), all timed by turns."""
    with fake_world(layout.world_size, 0), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # nothing moves in this world: values are whatever memory held
        models = [(spec.build(depth), seq_len)]
        if layout.degrees:
            from meshtrain.parallel.mesh import ParallelMesh

            model = spec.build(depth)
            options, pipeline = default_options(layout, None, None,
                                                sequence_parallel=sequence_parallel)
            (model,) = this_ranks_modules(model, ParallelMesh(layout, "cpu"), options,
                                          pipeline)
            models.append((model, seq_len // cp))
        # by turns: a slower stretch of the machine weighs on both alike (timed apart, a
        # burst during one of them moved the split between fixed and per-sample cost,
        # and with it the planner's pick: benchmarks/README.md, 2026-11-28)
        times = _fastest_by_turns([_pass(spec, model, batch, length)
                                   for model, length in models for batch in (16, 1)], seconds)
    return [(times[i], times[i + 1]) for i in range(0, len(times), 2)]


def _pass(spec, model, batch: int, length: int):
    """One forward and backward at ``batch`` sequences, as a function to time."""
    inputs = spec.batch(batch, length)
    return lambda: spec.loss(model, inputs).backward()


@functools.lru_cache(maxsize=64)
def sharding_host_seconds(spec, shards: int, zero_stage: int, seq_len: int,
                          seconds: float = 0.5) -> tuple[float, float] | None:
    """(seconds per micro-batch, seconds per step) that sharding the job's whole model over
    ``shards`` ranks at ``zero_stage`` (2 or 3) adds on one rank, one CPU thread: forward and
    backward of one sequence, and the AdamW step, sharded in a simulated world against the
    same model whole (its optimizer step divided by ``shards``: what the estimate's bytes
    count already), the two run by turns (the fastest of each). None if the whole model is too
    large to run here."""
    with torch.device("meta"):
        if sum(p.numel() for p in spec.build().parameters()) > MAX_PARAMS:
            return None
    from meshtrain.parallel.mesh import ParallelMesh

    layout = Layout.parse(f"zero{zero_stage}={shards}", shards)
    tokens = spec.batch(1, seq_len)
    with _one_thread(), fake_world(shards, 0), torch.random.fork_rng(devices=[]), \
            warnings.catch_warnings():
        # torch's note on a root returning a view, about a layout the user did not choose
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        torch.manual_seed(0)
        whole, sharded = spec.build(), spec.build()
        options, pipeline = default_options(layout, None, None)
        (sharded,) = this_ranks_modules(sharded, ParallelMesh(layout, "cpu"), options,
                                        pipeline)
        runs = []
        for model in (whole, sharded):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            runs += [lambda m=model: spec.loss(m, tokens).backward(), optimizer.step]
        fb_whole, step_whole, fb_sharded, step_sharded = _fastest_by_turns(runs, seconds)
    return max(0.0, fb_sharded - fb_whole), max(0.0, step_sharded - step_whole / shards)


def _fastest_by_turns(fns, seconds: float) -> list[float]:
    """The fastest run of each of ``fns``, called in turn for ``seconds`` (at least 3 rounds)
    after one untimed round: a slower stretch of the machine weighs on all of them alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    rounds, start = 0, time.perf_counter()
    while rounds < 3 or time.perf_counter() - start < seconds:
        for i, fn in enumerate(fns):
            begin = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - begin)
        rounds += 1
    return best
