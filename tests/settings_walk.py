"""What a run does, recorded cheaply, so that tests/test_every_setting.py can show that each
Trainer setting changes it (or is refused): :func:`run_configs` trains a few steps of a tiny
model per configuration (in this process, or as one rank of a ``run_workers`` job) and returns
a fingerprint of each run, or the ConfigError that refused it before any process started.

A fingerprint holds what the run did, never the settings it was given: the steps and the logged
metrics, every rank's parameters as it holds them, the files of the run folder and where it is,
what rank 0 printed, every module's forward calls (inputs' shapes, placements, whether
gradients were there yet: a schedule's order), which devices the model was built on, the
modules' classes and hooks, the meshtrain objects the Trainer built (by type), and during a
step the threads and child processes it started, its signal handlers and its process groups'
timeouts. Numbers that are clocks (throughput, MFU, seconds) are left out, except the peak that
MFU is measured against.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import signal
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from walk_jobs import MAKERS, adamw, job

from meshtrain import Callback, Trainer
from meshtrain.errors import ConfigError

TIMING = re.compile(r"per_s|tflops|mfu|seconds|time|_s$|_ms$")


def settings_of(config: dict, ctx: dict) -> dict:
    """The Trainer keywords of ``config``: its settings, with ``{"make": name}`` values made."""
    return {k: MAKERS[v["make"]](ctx) if isinstance(v, dict) and "make" in v else v
            for k, v in config["settings"].items()}


# -- the fingerprint ------------------------------------------------------------------------------
def _tensor(x) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return ("DTensor", tuple(x.to_local().shape), str(x.placements), str(x.dtype))
    return ("Tensor", tuple(x.shape), str(x.dtype), x.device.type)


def _output(out) -> tuple | str:
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    return _tensor(out) if isinstance(out, torch.Tensor) else type(out).__name__


def _digest(t: torch.Tensor) -> str:
    local = t.to_local() if hasattr(t, "to_local") else t
    data = local.detach().cpu().float().contiguous().numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


def _children() -> set[int]:
    """This process's child processes (Linux: each thread's /proc children list)."""
    found = set()
    for tasks in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found.update(int(pid) for pid in tasks.read_text().split())
    return found


def _timeouts() -> list[float]:
    """The distinct timeouts of this process's process groups (seconds)."""
    if not dist.is_initialized():
        return []
    found = set()
    for group in list(dist.distributed_c10d._world.pg_map):
        with contextlib.suppress(Exception):
            backend = group._get_backend(torch.device("cpu"))
            backend = getattr(backend, "wrapped_pg", backend)
            found.add(backend.options._timeout.total_seconds())
    return sorted(found)


def _handler(signum) -> str:
    handler = signal.getsignal(signum)
    return getattr(handler, "__qualname__", str(handler))


def _machinery(trainer) -> list:
    """The types of the objects the Trainer built that its meshtrain objects hold (types only,
    never values: a setting copied somewhere and never used does not show)."""
    found: Counter = Counter()
    seen: set[int] = set()
    stack = [v for k, v in vars(trainer).items() if k not in ("_settings", "callbacks")]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (bool, int, float, str, bytes, Path,
                                                              torch.Tensor, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
            continue
        kind = type(obj)
        if kind.__module__ != "builtins":
            found[f"{kind.__module__}.{kind.__qualname__}"] += 1
        if kind.__module__.startswith("meshtrain.") and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return sorted(found.items())


def _structure(model: torch.nn.Module) -> list:
    """Each module: its class, the attributes it holds (hooks, a compiled call, a wrapper's
    state), and the plain values of torch's own wrappers (DDP's bucket size)."""
    rows = []
    for name, module in model.named_modules():
        held = sorted(k for k, v in vars(module).items()
                      if v is not None and not (isinstance(v, (dict, list, set, tuple)) and not v))
        knobs = {}
        if type(module).__module__.startswith("torch.nn.parallel"):
            knobs = {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str))}
        rows.append((name, type(module).__qualname__, held, sorted(knobs.items())))
    return rows


class Recorder(Callback):
    """Records a run: build devices and forward calls (through :meth:`factory`), steps and
    logged metrics, and the process's state during step 2."""

    def __init__(self):
        self.builds, self.forwards, self.logged, self.state = [], [], [], {}
        self.in_step = False  # (the checks before fit run the model too, and trace its weights)
        self.threads = {t.ident for t in threading.enumerate()}
        self.children = _children()

    def factory(self, build):
        def make():
            model = build()
            self.builds.append(torch.empty(0).device.type)
            for name, module in model.named_modules():
                module.register_forward_hook(self._hook(name))
            return model
        return make

    def _hook(self, name):
        def record(module, args, output):
            has_grads = self.in_step and any(p.grad is not None for p in module.parameters())
            self.forwards.append((name, module.training, torch.is_grad_enabled(), has_grads,
                                  _output(args), _output(output)))
        return record

    def on_train_step_start(self, trainer):
        self.in_step = True
        if trainer.global_step == 0:
            self.state["first step timeouts"] = _timeouts()

    def on_train_step_end(self, trainer, metrics):
        self.in_step = False
        self.logged.append((trainer.global_step, _metrics(metrics)))
        if trainer.global_step == 2:
            self.state.update({
                "threads": sorted(re.sub(r"\d+", "#", t.name) for t in threading.enumerate()
                                  if t.ident not in self.threads),
                "children": len(_children() - self.children),
                "signals": [_handler(s) for s in (signal.SIGUSR1, signal.SIGUSR2)],
                "timeouts": _timeouts(),
                "default group": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
                if dist.is_initialized() else None,
            })


def _metrics(metrics: dict) -> list:
    """The metrics without clocks; the peak MFU is measured against (tflops / mfu) kept."""
    rows = [(k, v if isinstance(v, str) else round(float(v), 12))
            for k, v in sorted(metrics.items()) if not TIMING.search(k)]
    rows += [(k, None) for k in sorted(metrics) if TIMING.search(k)]
    if metrics.get("train/mfu"):
        rows.append(("peak", round(metrics["train/tflops"] / metrics["train/mfu"], 6)))
    return rows


def _stdout(text: str, cwd: str) -> list[str]:
    """Rank 0's lines, without the folder, times and clock-like numbers (with a decimal point
    or a thousands comma), and without fit's summary line (a throughput) and the network line
    (the first fit of a process names the interface, later ones keep it)."""
    text = re.sub(r"\d{8}-\d{6}(-\d+)?", "<time>", text.replace(cwd, "<cwd>"))
    return [re.sub(r"\d[\d,]*\.\d+|\d+(,\d{3})+", "#", line) for line in text.splitlines()
            if not line.startswith(("fit: ", "network: "))]


def fingerprint(trainer, recorder: Recorder, out: str, cwd: str, outcome: str) -> dict:
    params = {}
    model = trainer.model
    if model is not None:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            params[name] = (*_tensor(t), _digest(t))
    folder = Path(trainer.run_dir) if trainer.run_dir is not None else None
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder else []
    where = re.sub(r"\d{8}-\d{6}(-\d+)?", "<time>", os.path.relpath(folder, cwd)) \
        if folder else None
    return {"outcome": outcome, "logged": recorder.logged,
            "final": _metrics(trainer.callback_metrics), "params": params, "files": files,
            "folder": where, "stdout": _stdout(out, cwd), "forwards": recorder.forwards,
            "builds": recorder.builds,
            "structure": _structure(getattr(trainer.engine, "train_module", None) or model)
            if model else None,
            "machinery": _machinery(trainer), "state": recorder.state}


def run_config(config: dict, ctx: dict) -> dict:
    """One run of ``config`` ({"settings", "job", "mode", "cwd", "errors": the exceptions it
    may end with}) in its own folder (``cwd`` under ctx["root"]): {"refused":
    message} when Trainer() or its check (everything before a process starts) refuses it, else
    {"fingerprint": ...}. mode "plan": only the Trainer's plan (no fit); "prepare": fit's
    preparation without its loop (a compiled model, compiled at its first step)."""
    spec = job(config["job"])
    recorder = Recorder()
    settings = settings_of(config, ctx)
    settings["callbacks"] = [recorder, *settings.get("callbacks", ())]
    model = recorder.factory(spec["model"])
    cwd = str(Path(ctx["root"], config["cwd"]))
    os.makedirs(cwd, exist_ok=True)
    here = os.getcwd()
    os.chdir(cwd)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            try:
                trainer = Trainer(**settings)
                if config["mode"] == "plan":
                    return {"fingerprint": {"plan": (str(trainer.layout), trainer.world_size,
                                                     trainer.micro_batch_size,
                                                     trainer.grad_accum_steps)}}
                trainer.check(model, spec["train"], spec["val"], optimizer=adamw,
                              loss_fn=spec["loss"])
            except ConfigError as error:
                return {"refused": str(error)}
            outcome = "ok"
            try:
                if config["mode"] == "prepare":
                    trainer.prepare(model, spec["train"], spec["val"], optimizer=adamw,
                                    loss_fn=spec["loss"])
                else:
                    trainer.fit(model, spec["train"], spec["val"], optimizer=adamw,
                                loss_fn=spec["loss"])
            except Exception as error:  # noqa: BLE001 - a run's outcome (NaN with "error")
                outcome = type(error).__name__
                if isinstance(error, ConfigError) and outcome not in config["errors"]:
                    return {"refused": str(error)}  # found on the ranks (a resume's step)
                if outcome not in config["errors"]:
                    raise
        if dist.is_initialized() and outcome == "ok":
            dist.barrier()  # every rank's files written before any lists them
        return {"fingerprint": fingerprint(trainer, recorder, out.getvalue(), cwd, outcome)}
    finally:
        os.chdir(here)


def run_configs(configs: list[dict], ctx: dict) -> list[dict]:
    """:func:`run_config` for each configuration, in order (a ``run_workers`` function too)."""
    return [run_config(config, ctx) for config in configs]
