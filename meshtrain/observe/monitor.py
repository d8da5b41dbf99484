"""What a fit measures on every rank and rank zero writes to the run folder for
``meshtrain report``: the step-time breakdown (meshtrain/observe/step_timer.py) gathered from
all ranks at each logging interval, model TFLOP/s and MFU, peak memory per rank, straggler
warnings, profiler traces of the ``profile_steps``, the run's events and its environment
(file formats: meshtrain/observe/run_files.py).

Nothing here synchronises a step: the breakdown is gathered in one small all-gather per
logging interval, when the loss is averaged anyway.
"""

from __future__ import annotations

import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.launch.spawn import DistEnv, _state
from meshtrain.observe import ending, run_files, stragglers
from meshtrain.observe.memory.limit import limit_description, memory_peak_and_limit
from meshtrain.observe.run_files import PARTS
from meshtrain.observe.step_timer import make_step_timer
from meshtrain.observe.stragglers import own_work


MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept in a CUDA memory snapshot


class RunMonitor:
    def __init__(self, *, run_dir: Path, rank: int, device: torch.device, group, world_size: int,
                 every: int | None, straggler_margin: float | None, profile_steps=None,
                 log=print):
        self.run_dir, self.rank, self.device, self.group = Path(run_dir), rank, device, group
        self.world_size, self.margin, self.log = world_size, straggler_margin, log
        self.timer = make_step_timer(every, device)
        self.flops_per_item = self.peak = None
        self.peak_source = ""
        self._own_work: list[dict[int, float]] = []  # the latest intervals' own work by rank
        self._straggler_named = None  # the straggler already warned of
        self._profile_steps = sorted(profile_steps or ())
        self._profiler = None
        self._unit = None
        self._count = None  # FLOPs to count on the first batch (rank zero)
        self.items = self.train_s = 0.0  # the fit's items (tokens or samples), over the ranks
        self._loop_start = None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    # -- the run --------------------------------------------------------------------------------
    def start(self, *, flops_per_item: float, peak_setting: float | None, layout: str,
              settings: dict | None = None, count=None) -> None:
        """Record the environment (rank zero), and the peak MFU is measured against (rank zero
        alone computes MFU): a CPU's is a 50 ms matmul measurement, made here at start-up
        rather than in the middle of the first logging interval's step. ``count``: a
        :class:`~meshtrain.observe.flops.FirstBatchCount` for a model that states no FLOPs
        (``flops_per_item`` is then 6 x parameters until the first logging interval)."""
        self.flops_per_item, self._peak_setting = flops_per_item, peak_setting
        if not self.is_zero:
            return
        self._count = count
        if count is not None:  # the first batch's shapes, taken as it leaves the loader
            self.timer.peek = count.see
        env = DistEnv.from_environ()
        device_name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                       else platform.processor() or platform.machine())
        ending.announce(self.run_dir)  # (for the launcher: observe/ending.py)
        run_files.update_environment(
            self.run_dir, torch=torch.__version__, python=platform.python_version(),
            platform=platform.platform(), hostname=socket.gethostname(),
            device_type=self.device.type, device_name=device_name, world_size=self.world_size,
            nodes=env.nodes if env else 1,
            processes_per_node=env.local_world_size if env else self.world_size, layout=layout,
            flops_per_item=flops_per_item, started=run_files.now(), finished=None,
            status="running", error=None, ending=None, settings=settings,
            **limit_description(self.device))
        if flops_per_item:
            self._find_peak()

    def _find_peak(self) -> None:
        from meshtrain.observe.flops import peak_tflops

        self.peak, self.peak_source = peak_tflops(self.device, self._peak_setting)
        run_files.update_environment(self.run_dir, peak_tflops=self.peak,
                                     peak_source=self.peak_source)

    def finish(self, error: BaseException | None = None, *, stop_reason: str | None = None,
               step: int | None = None) -> None:
        """The run ended: ``error`` how it failed, ``stop_reason`` why the loop stopped early
        ("signal": preempted); stops a profiler still running. Rank zero records the ending
        (observe/ending.py): a lost connection's cause is the first failing rank's error;
        other ranks put their error in the job's store for it."""
        self._stop_profiler()
        if error is not None and not self.is_zero:
            ending.publish_failure(error, self.rank, step)
        if not self.is_zero or not (self.run_dir / run_files.ENVIRONMENT).exists():
            return
        if error is not None:
            found = ending.failure_ending(error, self.rank, step, workers=_state["workers"])
            ending.record_ending(self.run_dir, **found, report=False)  # (fit writes it)
        elif stop_reason == "signal":
            ending.record_ending(self.run_dir, "preempted", step=step,
                                 cause="stopped on a signal (stop_on_signal) after a "
                                       "resumable checkpoint")
        else:
            ending.record_ending(self.run_dir, "finished", step=step, cause=stop_reason)

    def event(self, kind: str, message: str, step: int | None = None, path=None) -> None:
        """One line in the run's events (rank zero)."""
        if self.is_zero:
            run_files.append_event(self.run_dir, kind, message, step, path)

    # -- each step ------------------------------------------------------------------------------
    def step_begins(self, step: int) -> None:
        """Optimizer step ``step`` (1-based) starts."""
        if self._loop_start is None:
            self._loop_start = time.perf_counter()
        if self._profile_steps and step == self._profile_steps[0] and self._profiler is None:
            self._start_profiler()
        self.timer.begin(step)

    def step_ends(self, step: int, gather: bool) -> None:
        """Step ``step`` ended; ``gather`` (every rank alike, at each logging interval): the
        breakdown of the interval's steps goes to breakdown.csv."""
        self.timer.end()
        if self._profiler is not None and step >= self._profile_steps[-1]:
            self._stop_profiler()
        if gather:
            self.gather_breakdown(step)

    def time_up(self, limit_minutes: float) -> bool:
        """(Every rank, at a logging interval.) Has rank zero's clock passed ``limit_minutes``
        since the first step? The same answer on every rank (one broadcast)."""
        late = time.perf_counter() - self._loop_start > 60 * limit_minutes
        flag = torch.tensor([float(late)], device=self.device)
        if self.group is not None and self.world_size > 1:
            dist.broadcast(flag, group=self.group, group_src=0)
        return bool(flag.item())

    def _counted(self) -> None:
        """The FLOPs per item counted on the first batch's shapes, once, where they count."""
        count, self._count, self.timer.peek = self._count, None, None
        counted = count.count()
        if counted is not None:
            self.flops_per_item = counted
            run_files.update_environment(self.run_dir, flops_per_item=counted,
                                         flops_source="FlopCounterMode, first batch's shapes")

    def interval_metrics(self, items_per_s: float, unit: str, items: float = 0.0,
                         seconds: float = 0.0) -> dict[str, float]:
        """Model TFLOP/s per rank and MFU over a logging interval (of ``items`` over all ranks
        in ``seconds``, counted for the run's summary)."""
        from meshtrain.observe.flops import mfu

        self.items, self.train_s = self.items + items, self.train_s + seconds
        if self.is_zero and unit != self._unit:  # known from the first batch on
            self._unit = unit
            run_files.update_environment(self.run_dir, unit=unit)
        if not self.is_zero or not self.flops_per_item or unit not in ("tokens", "samples"):
            return {}
        if self._count is not None:
            self._counted()
        if self.peak is None:
            self._find_peak()
        achieved, fraction = mfu(self.flops_per_item, items_per_s, self.world_size, self.peak)
        return {"train/tflops": achieved, "train/mfu": fraction}

    def gather_breakdown(self, step: int) -> list[dict] | None:
        """(Every rank, at a logging interval.) Each rank's mean breakdown since the last
        interval, gathered; rank zero writes it to breakdown.csv and looks for a straggler.
        Returns the rows on rank zero."""
        values = self.timer.take_window()
        peak, limit = memory_peak_and_limit(self.device)
        mine = torch.tensor([1.0 if values else 0.0, *(values or [0.0] * (2 + len(PARTS))),
                             float(peak), float(limit)], dtype=torch.float64)
        if self.group is not None and self.world_size > 1:
            mine = mine.to(self.device)
            gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        if not self.is_zero:
            return None
        rows = []
        for rank, row in enumerate(t.tolist() for t in gathered):
            if not row[0]:
                continue
            seconds = dict(zip(("wall_s", "step_s", *(f"{p}_s" for p in PARTS)),
                               row[1:3 + len(PARTS)]))
            rows.append({"step": step, "rank": rank, **seconds,
                         "mem_peak_bytes": int(row[-2]), "mem_limit_bytes": int(row[-1])})
        if rows:
            run_files.append_breakdown(self.run_dir, rows)
            self.look_for_straggler(step, rows)
        return rows

    def look_for_straggler(self, step: int, rows: list[dict]) -> None:
        """A rank that :func:`meshtrain.observe.stragglers.judge` calls a straggler (its own
        work above the other ranks' by more than ``straggler_margin``, their spread and the
        run's jitter, ``PATIENCE`` intervals in a row): named once, when it becomes one, with
        the part where it spends the most beyond the others."""
        if self.margin is None or len(rows) < 2:
            return
        self._own_work.append({r["rank"]: own_work(r) for r in rows})
        del self._own_work[:-stragglers.WINDOW]
        verdict = stragglers.judge(self._own_work, self.margin)
        rank, named = verdict.straggler, self._straggler_named
        self._straggler_named = rank
        if rank is None or rank == named:
            return
        by_rank = {r["rank"]: r for r in rows}
        excess = {p: by_rank[rank][f"{p}_s"] - statistics.median(
            by_rank[r][f"{p}_s"] for r in by_rank if r != rank)
            for p in PARTS if p not in stragglers.WAITS}
        part = max(excess, key=excess.get)
        mine, others = verdict.own, verdict.others
        message = (f"rank {rank} is a straggler: its own work takes {mine * 1e3:.1f} ms per "
                   f"step against {others * 1e3:.1f} ms on the other ranks (median), "
                   f"{mine / max(others, 1e-12):.2f}x, {verdict.slow_intervals} logging "
                   f"intervals in a row (beyond the margin, the other ranks' spread and "
                   f"{stragglers.NOISE_TIMES}x its jitter of {verdict.jitter * 1e3:.1f} ms); "
                   f"the slow part is {part} "
                   f"(+{excess[part] * 1e3:.1f} ms per step; the others wait for it in "
                   "their comm/bubble)")
        self.log(f"warning: step {step}: {message}")
        self.event("straggler", message, step)

    def summary(self, t, wall_s: float) -> str:
        """The lines ``fit`` ends with on rank zero: time, steps, mean throughput, the best
        checkpoint and its metric, the final metrics; an MoE model's most imbalanced expert
        layer of the last logged steps."""
        from meshtrain.callbacks import ModelCheckpoint

        unit = self._unit or "samples"
        lines = [f"fit: {t.global_step} steps in {wall_s:.1f} s ({t.global_step / max(wall_s, 1e-9):.2f}"
                 f" steps/s; {self.items / max(self.train_s, 1e-9):,.0f} {unit}/s over the "
                 f"training steps)" + (f", {t.num_skipped_steps} skipped" if t.num_skipped_steps
                                       else "")]
        final = {k: v for k, v in t.callback_metrics.items()  # the user's own included
                 if k not in run_files.NOT_SUMMARISED}
        if final:
            lines.append("final: " + ", ".join(f"{k} {v:.4g}" for k, v in final.items()))
        for cb in t.callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.best_model_path is not None:
                score = cb.best_k.get(cb.best_model_path)
                lines.append(f"best checkpoint: {cb.best_model_path}" + (
                    f" ({cb.monitor} {score:.4g})" if score is not None else ""))
        if (self.run_dir / run_files.EXPERTS).exists():  # an MoE model's last steps
            from meshtrain.observe.report.experts import worst_layer

            if (worst := worst_layer(run_files.read_expert_load(self.run_dir))) is not None:
                lines.append(f"experts: {worst.sentence()}")
        return "\n".join(lines)

    # -- profiler -------------------------------------------------------------------------------
    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            # and the CUDA allocator's history: every allocation and free with its stack, for
            # https://pytorch.org/memory_viz (torch's documented memory-snapshot functions)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        path = self.run_dir / "traces" / f"rank{self.rank}.json"
        path.parent.mkdir(exist_ok=True)
        profiler.export_chrome_trace(str(path))
        first, last = self._profile_steps[0], self._profile_steps[-1]
        memory = ""
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(path.parent / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            memory = "; CUDA memory snapshots memory_rank*.pickle (https://pytorch.org/memory_viz)"
        self.event("profile", f"torch profiler trace of steps {first}-{last} on every rank "
                   f"(open in https://ui.perfetto.dev){memory}", last, path.parent)
