"""How ``meshtrain parity`` judges a layout: the job trained in float64 on both sides.

In float64 a layout that computes what one process computes agrees with it to ~1e-12 (only the
order of sums differs), while a real bug (a gradient summed twice, a window ignored, a loss
scaled) stays 1e-3..1e-5 away: orders of magnitude apart, so rounding can neither hide nor fake
a difference. So, whenever the job can be cast (the model ``.double()``, its floating data cast:
:func:`float64_job`), one process and each layout train in float64 too, and each tensor of the
final state, each step's loss and each step's gradient norm is judged relative to its size:

    pass  if  |layout64 - one process64| <= max(F64_TOL, FLOOR_SLACK x floor)

``floor``: how far one process moves in float64 when only its micro-batch split changes. Some
models compute parts in float32 on purpose even when cast (Gemma's RMSNorm: ``x.float()``), and
their float64 runs part by ~1e-8 under any change of the order of sums: still far below a bug.
A floor above FLOOR_CAP means the split itself changes the training (batch statistics, a loss
averaged per micro-batch): it is no floor, and the bound stays F64_TOL.

The fp32 runs stay in the table as information. A layout that cannot run in float64 is judged in
fp32 (:func:`compare`), and marked so: per tensor no farther from the float64 one process than
SLACK x the fp32 one process, or, with no float64 run at all, the fixed tolerance. A parameter
whose gradient is ~0 in one process (an attention key bias: softmax ignores a shift shared by
all keys) moves only by the optimizer's reaction to rounding noise (AdamW divides it by its own
root mean square): it is listed, not judged.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from meshtrain.callbacks import Callback
from meshtrain.errors import ConfigError

#: float64: a layout may differ from one process by this much (relative to each value)
F64_TOL = 1e-9
#: ... or by this many times the model's own float64 floor, when it has one below FLOOR_CAP
FLOOR_SLACK, FLOOR_CAP = 10.0, 1e-6
#: the fp32 verdict: a layout may be this many times farther from float64 than one process is
SLACK = 2.0
#: a gradient whose largest element stays below this fraction of the largest gradient element
#: of the model over every step is "~0"
ZERO_GRADIENT = 1e-6


class GradSizes(Callback):
    """Records each parameter's largest absolute gradient element over the steps (one process:
    plain tensors, full-model names); kept on the device, read once (``sizes``) at the end."""

    def __init__(self):
        self._largest: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer):
        for name, param in trainer.model.named_parameters():
            if param.grad is not None and param.grad.numel():
                size = param.grad.detach().abs().max()
                old = self._largest.get(name)
                self._largest[name] = size if old is None else torch.maximum(old, size)

    @property
    def sizes(self) -> dict[str, float]:
        return {name: float(size) for name, size in self._largest.items()}


def zero_gradient(sizes: dict[str, float]) -> set[str]:
    """The parameters whose gradient is ~0 (:data:`ZERO_GRADIENT`)."""
    largest = max(sizes.values(), default=0.0)
    return {name for name, size in sizes.items() if size <= ZERO_GRADIENT * largest}


# -- the float64 truth --------------------------------------------------------------------------
def _to_float64(value):
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_float64(v) for k, v in value.items()}
    return value


class Float64Samples(torch.utils.data.Dataset):
    """A map-style dataset's samples with their floating-point tensors in float64."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return _to_float64(self.data[index])

    def __getattr__(self, name):  # the dataset's own attributes (tokens per sample, ...)
        if name in ("data", "__getitems__"):  # (a batched fetch would skip the cast)
            raise AttributeError(name)
        return getattr(self.data, name)


def float64_job(job: dict) -> dict:
    """The job computed in float64: the model built as asked, then cast; the data's floating
    tensors cast; fp32 precision (no autocast). ConfigError when it cannot be."""
    data = job["train_data"]
    if isinstance(data, (torch.utils.data.DataLoader, torch.utils.data.IterableDataset)) \
            or not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ConfigError("a float64 reference needs a map-style dataset (len and [i]); "
                          f"train_data is a {type(data).__name__}")
    model = job["model"]
    if isinstance(model, torch.nn.Module):
        instance = model
        model = lambda: copy.deepcopy(instance).double()  # noqa: E731 -- the job's model, cast
    else:
        factory = model
        model = lambda: factory().double()  # noqa: E731
    settings = {**job["settings"], "precision": "fp32"}
    return {**job, "model": model, "train_data": Float64Samples(data), "settings": settings}


# -- the verdict --------------------------------------------------------------------------------
@dataclass
class Row:
    """One layout against one process: in float64 when both could run so, else in fp32."""

    layout: str
    ranks: int
    max_param_diff: float = math.nan  # fp32: largest |layout - one process| over the parameters
    max_loss_diff: float = math.nan  # fp32: largest |layout - one process| over the losses
    rel64: float = math.nan  # float64: the worst judged tensor, |layout - one process| / size
    bound: float = math.nan  # float64: what any tensor, loss or gradient norm may part by
    first_divergence: int | None = None  # 1-based step whose loss or gradient norm parts
    parted: str = ""  # which of the two parted first
    worst_param: str = ""  # the tensor nearest to its bound (or farthest past it)
    rel_diff: float = math.nan  # fp32 verdict: worst_param's |layout - T| / |T|
    ref_rel_diff: float = math.nan  # fp32 verdict: |one process - T| / |T| (0 without float64)
    tensors_ok: bool = True
    zero_gradient: list[str] = field(default_factory=list)
    seconds: float = math.nan
    error: str = ""
    tol: float = 1e-5
    fp32_verdict: str = ""  # why this row is judged in fp32 ("": judged in float64)
    note: str = ""  # what else the run showed (e.g. equal to one process cut as it cuts)

    @property
    def ok(self) -> bool:
        return not self.error and self.tensors_ok and self.first_divergence is None

    def cells(self) -> list[str]:
        if self.error:
            return [self.layout, str(self.ranks)] + ["-"] * 7 + ["ERROR: " + self.error]
        step = "-" if self.first_divergence is None else str(self.first_divergence)
        in64 = not self.fp32_verdict
        if self.ok:
            result = "ok" if in64 else "ok (fp32 verdict)"
        elif self.first_divergence is not None:
            result = (f"FAIL: diverges at step {self.first_divergence} ({self.parted}); "
                      f"worst tensor {self.worst_param}")
        elif in64:
            result = f"FAIL: {self.worst_param} {self.rel64:.1e} beyond {self.bound:.0e}"
        else:
            result = (f"FAIL: {self.worst_param} beyond max(tol {self.tol:.0e}, {SLACK:g} x "
                      "one process) (fp32 verdict)")
        return [self.layout, str(self.ranks), f"{self.rel64:.1e}" if in64 else "-",
                f"{self.bound:.0e}" if in64 else "fp32", step, self.worst_param,
                f"{self.max_param_diff:.2e}", f"{self.max_loss_diff:.2e}", f"{self.seconds:.1f}",
                result]


HEADER = ["layout", "ranks", "float64 rel. error", "bound", "diverges at step", "worst tensor",
          "fp32 max |dparam|", "fp32 max |dloss|", "seconds", "result"]


def _relative(x: torch.Tensor, truth: torch.Tensor) -> float:
    if not x.numel():
        return 0.0
    scale = truth.abs().max().item()
    return (x - truth).abs().max().item() / (scale if scale > 0 else 1.0)


def _same_shape(want: dict, got: dict, row: Row) -> bool:
    """Do two runs hold the same tensors and steps? (Else ``row.error`` says how not.)"""
    if sorted(want["params"]) != sorted(got["params"]):
        missing = sorted(set(want["params"]) - set(got["params"]))
        extra = sorted(set(got["params"]) - set(want["params"]))
        row.error = f"the layout's model has other parameters: missing {missing[:3]}, extra {extra[:3]}"
        return False
    shapes = [k for k in want["params"] if got["params"][k].shape != want["params"][k].shape]
    if shapes:
        k = shapes[0]
        row.error = (f"parameter {k} has shape {tuple(got['params'][k].shape)}, one process "
                     f"{tuple(want['params'][k].shape)}")
        return False
    if len(got["losses"]) != len(want["losses"]):
        row.error = f"ran {len(got['losses'])} steps, one process {len(want['losses'])}"
        return False
    return True


def fp32_differences(reference: dict, run: dict, row: Row) -> Row:
    """The table's fp32 columns: largest |layout - one process| over parameters and losses."""
    if not _same_shape(reference, run, row):
        return row
    want, got = reference["params"], run["params"]
    row.max_param_diff = max(((got[k].double() - want[k].double()).abs().max().item()
                              for k in want if want[k].numel()), default=0.0)
    losses = run["losses"]
    row.max_loss_diff = float((losses - reference["losses"]).abs().max()) if len(losses) else 0.0
    row.seconds = run["seconds"]
    return row


def _step_parts(run: torch.Tensor, ref: torch.Tensor, nan_parts: bool = True) -> torch.Tensor:
    """Per step, |run - ref| relative to |ref|: inf where only one of them is NaN, unless
    ``nan_parts`` is False and it is ``run`` (a layout without a global norm, ps, records NaN)."""
    rel = (run - ref).abs() / ref.abs().clamp(min=1e-300)
    rel = torch.where(run.isnan() & ref.isnan(), torch.zeros_like(rel), rel)
    rel = torch.where(run.isnan() != ref.isnan(), torch.full_like(rel, math.inf), rel)
    return rel if nan_parts else torch.where(run.isnan(), torch.zeros_like(rel), rel)


def differences64(one: dict, other: dict, judged) -> dict[str, float]:
    """Relative differences of two float64 runs: per judged tensor, and "loss" / "gradient
    norm" (their largest over the steps)."""
    parts = {k: _relative(other["params"][k].double(), one["params"][k].double())
             for k in judged}
    for key, what in (("losses", "loss"), ("grad_norms", "gradient norm")):
        steps = _step_parts(other[key], one[key])
        parts[what] = float(steps.max()) if len(steps) else 0.0
    return parts


def model_floor(one: dict, split: dict | None) -> float | None:
    """The model's own float64 floor: how far one process moves when only its micro-batch
    split changes (None without that run, or when the split changes the training itself)."""
    if split is None or not _same_shape(one, split, Row("", 1)):
        return None
    judged = set(one["params"]) - zero_gradient(one.get("grad_sizes", {}))
    floor = max(differences64(one, split, judged).values(), default=0.0)
    return floor if floor <= FLOOR_CAP else None


def compare_float64(one: dict, run: dict, row: Row, floor: float | None = None) -> Row:
    """Judge ``row`` by the layout's float64 ``run`` against one process's float64 run."""
    if not _same_shape(one, run, row):
        return row
    row.fp32_verdict, row.bound = "", max(F64_TOL, FLOOR_SLACK * (floor or 0.0))
    row.zero_gradient = sorted(zero_gradient(one.get("grad_sizes", {})))
    judged = [k for k in one["params"] if k not in row.zero_gradient]
    parts = differences64(one, run, judged)
    tensors = {k: parts[k] for k in judged}
    row.worst_param = max(tensors, key=tensors.get, default="")
    row.rel64 = tensors.get(row.worst_param, 0.0)
    row.tensors_ok = row.rel64 <= row.bound
    first = None
    for key, what in (("losses", "loss"), ("grad_norms", "gradient norm")):
        bad = (_step_parts(run[key], one[key], key == "losses") > row.bound).nonzero()
        if len(bad) and (first is None or int(bad[0]) < first[0]):
            first = (int(bad[0]), what)
    row.first_divergence, row.parted = (first[0] + 1, first[1]) if first else (None, "")
    return row


def _diverged(run: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, tol: float,
              nan_parts: bool = True):
    """Per step: does ``run`` part from ``truth`` by more than max(tol, SLACK x ref's part)
    (relative to the value, at least 1)? ``nan_parts``: a NaN on one side only counts."""
    n = min(len(run), len(truth), len(ref))
    run, ref, truth = run[:n], ref[:n], truth[:n]
    scale = truth.abs().clamp(min=1.0)
    allowed = torch.maximum(torch.full_like(truth, tol), SLACK * (ref - truth).abs() / scale)
    parted = (run - truth).abs() / scale > allowed
    return parted | (run.isnan() != truth.isnan()) if nan_parts else parted


def compare(reference: dict, run: dict, row: Row, truth: dict | None = None,
            why: str = "no float64 run") -> Row:
    """The fp32 verdict: fill ``row`` from a layout's fp32 ``run`` against the fp32 one-process
    ``reference`` and, when given, the float64 one-process ``truth``; ``why`` it is judged so."""
    if fp32_differences(reference, run, row).error:
        return row
    row.fp32_verdict = why
    want, got = reference["params"], run["params"]
    true = truth or reference
    row.zero_gradient = sorted(zero_gradient(true.get("grad_sizes", {})))
    worst = -1.0
    for k in want:
        if k in row.zero_gradient:
            continue
        t = true["params"][k].double()
        mine, ref = _relative(got[k].double(), t), _relative(want[k].double(), t)
        allowed = max(row.tol, SLACK * ref) if truth else row.tol
        if mine / allowed > worst:
            worst, row.worst_param, row.rel_diff, row.ref_rel_diff = mine / allowed, k, mine, ref
    row.tensors_ok = worst <= 1.0
    bad = _diverged(run["losses"], reference["losses"], true["losses"], row.tol)
    # (a layout without a global norm, ps, records NaN: not a divergence)
    bad = bad | _diverged(run["grad_norms"], reference["grad_norms"], true["grad_norms"],
                          row.tol, False)
    if bad.any():
        row.first_divergence, row.parted = int(bad.nonzero()[0]) + 1, "loss or gradient norm"
    return row


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
