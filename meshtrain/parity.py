"""``meshtrain parity``: does a layout change the training? Train a job K steps in one process and
under each layout, and compare every step's loss and gradient norm and the final parameters.

    meshtrain parity CONFIG.toml --layouts "dp=2;zero3=2;tp=2;pp=2" --steps 10 [--section.key=value ...]
    meshtrain parity mypkg.train:job --layouts "dp=2;tp=2"    # a Python entry point

A config's recipe supplies the job through ``job(config)`` (the built-in ``char_lm`` does); an
entry point ``module:function`` returns the same mapping: ``model`` (a module factory),
``train_data``, ``optimizer`` (a factory), ``loss_fn`` and optionally ``lr_scheduler`` (a factory)
and ``settings`` (Trainer keywords, e.g. ``{"global_batch_size": 16}``; ``--section.key=value``
overrides them). Every run uses the job's settings with the layout replaced, less the settings
that need what its layout lacks (a ``tp_plan`` without tp); checkpoints, validation and loggers
are off. fp32 parity is exact up to summation order: tolerance 1e-5.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

from meshtrain.callbacks import Callback
from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import _parse_pairs
from meshtrain.parallel.whole_state import whole_state
from meshtrain.parity_verdict import HEADER, GradSizes, Row, compare, float64_job, table

__all__ = ["HEADER", "Row", "Source", "compare", "parity", "table", "train"]

#: max |dparam| and |dloss| a layout may differ from one process by, per precision
#: (mixed precision: see docs/reference or benchmarks/README.md for how they were measured)
TOLERANCE = {"fp32": 1e-5}

#: settings every parity run uses, whatever the job says: nothing but training
QUIET = dict(loggers=(), progress_bar=False, report=False, save_final_checkpoint=False, resume=None,
             checkpoint_every_n_steps=None, checkpoint_every_n_minutes=None,
             val_every_n_steps=None, log_every_n_steps=1, log_grad_norm=True, max_epochs=None)


class Curves(Callback):
    """Records every step's logged loss (averaged over the ranks) and gradient norm."""

    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_train_step_end(self, trainer, metrics):
        if "train/loss" in metrics:
            self.losses.append(metrics["train/loss"])
        norm = trainer.grad_norm
        self.grad_norms.append(float(norm) if norm is not None else float("nan"))


# -- the job: what to train -------------------------------------------------------------------
@dataclass
class Source:
    """Where the job comes from: a TOML config (with overrides) or a ``module:function``."""

    target: str
    overrides: tuple[str, ...] = ()

    @property
    def is_config(self) -> bool:
        return self.target.endswith(".toml") or os.path.isfile(self.target)

    def load(self) -> dict:
        """The job mapping, with ``settings`` resolved (overrides applied and checked)."""
        from meshtrain import settings

        if self.is_config:
            from meshtrain.recipes import resolve_config

            recipe, config, flat = resolve_config(self.target, list(self.overrides))
            make = getattr(recipe, "job", None)
            if make is None:
                raise ConfigError(
                    f"the recipe of {self.target} has no job(config) function, which meshtrain "
                    "parity calls to build the model, data, optimizer and loss; add one (see "
                    "meshtrain/recipes/char_lm.py) or point parity at a Python entry point")
            job = dict(make(config))
            job["settings"] = {**flat, **job.get("settings", {})}
        else:
            job = dict(_entry_point(self.target)())
            job["settings"] = _apply_overrides(dict(job.get("settings", {})), self.overrides)
            settings.check(job["settings"])
        missing = [k for k in ("model", "train_data", "optimizer") if job.get(k) is None]
        if missing:
            raise ConfigError(f"the job from {self.target} has no {', '.join(missing)}; it must "
                              "give model, train_data, optimizer (and loss_fn unless the model "
                              "returns its loss)")
        return job


def _entry_point(target: str):
    import importlib

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"cannot read {target!r}: give a config file (.toml) or a Python entry "
                          "point 'package.module:function' that returns the job")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError(f"cannot import {module_name!r} for {target!r} ({error}); it must be "
                          f"importable from the current directory ({os.getcwd()}) or "
                          "PYTHONPATH") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{module_name!r} has no function {attribute!r} (from {target!r})")
    return function


def _apply_overrides(flat: dict, overrides) -> dict:
    from meshtrain import settings
    from meshtrain.config import parse_override, unknown_key_message

    for text in overrides:
        section, key, value = parse_override(text)
        setting = settings.SETTINGS.get(key)
        if setting is None or setting.section != section:
            raise ConfigError(unknown_key_message(settings.config_sections(), section, key,
                                                  f"override {text!r}", settings.python_only()))
        flat[key] = value
    return flat


# -- one run ---------------------------------------------------------------------------------
def layout_world_size(layout: str) -> int:
    """How many processes ``layout`` needs (its degrees multiplied; no 'auto' axis)."""
    pairs = _parse_pairs(layout)
    if any(str(v).strip().lower() in ("auto", "-1") for v in pairs.values()):
        raise ConfigError(f"layout {layout!r}: meshtrain parity needs every degree written out "
                          "(no 'auto'), so it knows how many processes to start")
    try:  # parameter servers (ps=S) are processes beside the mesh's
        servers = int(pairs.pop("ps", 0))
        return math.prod(int(v) for v in pairs.values()) + servers
    except ValueError:
        raise ConfigError(f"layout {layout!r}: degrees must be integers") from None


def run_settings(job: dict, layout: str | None, steps: int, run_dir: str) -> dict:
    """The Trainer settings of one run: the job's, quiet, under ``layout`` (one process when
    None). A setting that needs what this layout lacks (``tp_plan`` without tp, a pipeline
    schedule without pp, a DDP hook without DDP: its ``needs`` in meshtrain/settings/table.py)
    is left out, so that the one-process reference and every other layout train without it."""
    from meshtrain import settings as table
    from meshtrain.parallel.layout import Layout

    world = 1 if not layout else layout_world_size(layout)
    settings = {**job["settings"], **QUIET, "layout": layout or None, "devices": world,
                "max_steps": steps, "run_dir": run_dir}
    if layout and "ps" in _parse_pairs(layout):  # the servers alone know the global norm
        settings["log_grad_norm"] = False
    for name in table.inapplicable(Layout.parse(layout or None, world), table.check(settings)):
        del settings[name]  # (its default, which needs nothing)
    return settings


def train(source: Source, layout: str | None, steps: int, quiet: bool = True,
          float64: bool = False) -> dict | None:
    """Train ``steps`` steps of the job under ``layout`` (one process when None; ``float64``:
    the job cast to float64) on this rank; rank 0 returns {"params", "losses", "grad_norms",
    "seconds"} (one process: also "grad_sizes", each parameter's largest gradient element),
    the other ranks None."""
    from meshtrain.trainer import Trainer

    if quiet:  # torch's performance notes, once per rank and run (--verbose shows them)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    job = source.load()
    if float64:
        job = float64_job(job)
    curves, sizes = Curves(), GradSizes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        kwargs = run_settings(job, layout, steps, run_dir)
        kwargs["callbacks"] = [curves, *([] if layout else [sizes]), *kwargs.get("callbacks", ())]
        with contextlib.redirect_stdout(open(os.devnull, "w")) if quiet else \
                contextlib.nullcontext():
            trainer = Trainer(**kwargs)
            model = trainer.fit(job["model"], job["train_data"], optimizer=job["optimizer"],
                                loss_fn=job.get("loss_fn"), lr_scheduler=job.get("lr_scheduler"))
        params = whole_state(model, trainer.layout.degree("pp"))
    if not trainer.is_global_zero:
        return None
    return {"params": params, "losses": torch.tensor(curves.losses, dtype=torch.float64),
            "grad_norms": torch.tensor(curves.grad_norms, dtype=torch.float64),
            "grad_sizes": sizes.sizes, "seconds": time.perf_counter() - start}


def _train_rank(source: Source, layout: str, steps: int, quiet: bool, float64: bool = False):
    try:
        return train(source, layout, steps, quiet, float64)
    except ConfigError as error:  # the message, not a traceback per rank
        raise SystemExit(f"meshtrain: error: {error}") from None


#: --reference: the truth each layout is judged against (meshtrain/parity_verdict.py)
REFERENCES = ("auto", "float64", "fp32")


def parity(source: Source, layouts: list[str], steps: int, *, tol: float | None = None,
           timeout: float = 600, quiet: bool = True, out=print,
           reference: str = "auto") -> list[Row]:
    """Train one process, then each layout; return one :class:`Row` per layout. ``reference``:
    "float64" also trains one process in float64 and judges each layout against it beside the
    fp32 one process; "auto" does when the job allows it (else as "fp32": the tolerance alone)."""
    if reference not in REFERENCES:
        raise ConfigError(f"--reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    from meshtrain.launch.spawn import run_workers
    from meshtrain.trainer import Trainer

    job = source.load()  # the job's own errors, before any process starts
    precision = job["settings"].get("precision") or "fp32"
    if tol is None:
        if precision not in TOLERANCE:
            raise ConfigError(f"no default parity tolerance for precision={precision!r}; pass "
                              f"--tol (measured tolerances: {TOLERANCE})")
        tol = TOLERANCE[precision]
    rows, runnable = [], []
    for layout in layouts:
        row = Row(layout, 0, tol=tol)
        try:
            row.ranks = layout_world_size(layout)
            with tempfile.TemporaryDirectory() as run_dir:  # refused before any process starts?
                Trainer(**run_settings(job, layout, steps, run_dir))
            runnable.append(row)
        except ConfigError as error:
            row.error = f"refused before start: {error}"
        rows.append(row)
    out(f"parity: {steps} steps of {source.target}, precision {precision}, tolerance {tol:.0e}; "
        f"one process first, then {len(runnable)} layout(s)")
    try:  # (not when every layout was refused: nothing to compare it with)
        ref32 = run_workers(_train_rank, 1, (source, None, steps, quiet),
                            timeout=timeout)[0] if runnable else None
    except Exception as error:  # noqa: BLE001 -- no reference: each row says why, not a crash
        for row in runnable:
            row.error = f"the one-process reference failed: {_last_line(str(error))}"
        runnable = []
    truth = None
    if runnable and reference != "fp32":
        try:
            truth = run_workers(_train_rank, 1, (source, None, steps, quiet, True),
                                timeout=timeout)[0]
            out("  judged against one process in float64 beside one process in fp32")
        except Exception as error:  # noqa: BLE001 -- a model that cannot run in float64
            why = _last_line(str(error))
            if reference == "float64":
                for row in runnable:
                    row.error = f"the float64 reference failed: {why}"
                runnable = []
            else:
                out(f"  no float64 reference ({why}): judged by the tolerance alone")
    for row in runnable:
        out(f"  {row.layout} on {row.ranks} process(es) ...")
        try:
            run = run_workers(_train_rank, row.ranks, (source, row.layout, steps, quiet),
                              timeout=timeout)[0]
        except Exception as error:  # noqa: BLE001 -- one failing layout is a row, not the end
            row.error = _last_line(str(error))
            continue
        compare(ref32, run, row, truth)
    out(table([HEADER] + [row.cells() for row in rows]))
    zero = sorted({name for row in rows for name in row.zero_gradient})
    if zero:
        out(f"~0 gradient in one process, so moved by the optimizer's reaction to rounding "
            f"alone (not judged): {', '.join(zero)}")
    return rows


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else text
    return last.removeprefix("SystemExit: ").removeprefix("meshtrain: error: ")


USAGE = """usage: meshtrain parity (CONFIG.toml | package.module:function) --layouts "L1;L2;..." \
    [--steps K] [--tol T] [--reference auto|float64|fp32] [--timeout S] [--verbose] \
    [--section.key=value ...]

Trains the job K steps (default 10) in one process and under each layout (separated by ';'),
quietly (--verbose: the runs' own output and warnings); with --reference float64 (auto: when the
job allows it) also one process in float64, the truth each run is measured against. Prints per
layout: max |dparam| and max |dloss| against one process, the first step whose loss or gradient
norm parts, the tensor closest to its bound with its relative error and one process's. A layout
passes when every tensor, loss and gradient norm is within the tolerance or no farther than 2x
one process from the float64 truth; parameters with a ~0 gradient are listed, not judged.
Exits 1 when any layout fails, errs or is refused.

Example: meshtrain parity examples/char_gpt.toml --layouts "dp=2;zero3=2;tp=2;pp=2" --steps 10"""


def main(argv: list[str]) -> int:
    """``meshtrain parity``: the command line."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    options = {"--layouts": None, "--steps": "10", "--tol": None, "--timeout": "600",
               "--reference": "auto"}
    verbose, rest = False, []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in options:
            options[name] = value if eq else next(args, None)
            if options[name] is None:
                raise ConfigError(f"{name} needs a value; {USAGE.splitlines()[0]}")
        elif arg == "--verbose":
            verbose = True
        else:
            rest.append(arg)
    if not rest or rest[0].startswith("--"):
        raise ConfigError(f"meshtrain parity needs a config file or entry point first\n{USAGE}")
    if not options["--layouts"]:
        raise ConfigError('meshtrain parity needs --layouts, e.g. --layouts "dp=2;zero3=2;tp=2"')
    layouts = [part.strip() for part in options["--layouts"].split(";") if part.strip()]
    try:
        steps, timeout = int(options["--steps"]), float(options["--timeout"])
        tol = None if options["--tol"] is None else float(options["--tol"])
    except ValueError as error:
        raise ConfigError(f"--steps, --tol and --timeout take numbers ({error})") from None
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    rows = parity(Source(rest[0], tuple(rest[1:])), layouts, steps, tol=tol, timeout=timeout,
                  quiet=not verbose, reference=options["--reference"])
    failed = [row.layout for row in rows if not row.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} layouts train like one process"
          + (f"; not: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
