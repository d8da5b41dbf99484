"""How ``meshtrain parity`` judges a layout: per tensor, relative to its size, and against the
float64 truth when the job can run in float64.

A layout changes the order of sums, which moves fp32 results by rounding; so does one process,
whose own fp32 kernels are no truth either (torch's CPU BatchNorm2d lands farther from a float64
computation than meshtrain's synchronised one). So, for each tensor of the final state and for
each step's loss and gradient norm, with T the float64 run (or, without one, the fp32 one
process):

    pass  if  |layout - T| <= max(tol, SLACK * |one process - T|)      (relative to |T|)

A layout no worse than one process passes whatever the fixed tolerance says; without a float64
run it is the plain tolerance. A parameter whose gradient is ~0 in one process (an attention key
bias: softmax ignores a shift shared by all keys) moves only by the optimizer's reaction to
rounding noise (AdamW divides it by its own root mean square): it is reported, not judged. The
first step where the loss or the gradient norm parts is the primary sign of a real bug.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from meshtrain.callbacks import Callback
from meshtrain.errors import ConfigError

#: a layout may be this many times farther from the float64 truth than one process is
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
        if name == "data":
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
    """One layout against one process (and the float64 truth when there is one)."""

    layout: str
    ranks: int
    max_param_diff: float = math.nan  # largest |layout - one process| over the parameters
    max_loss_diff: float = math.nan  # largest |layout - one process| over the steps' losses
    first_divergence: int | None = None  # 1-based step whose loss or gradient norm parts
    worst_param: str = ""  # the tensor nearest to its bound (or farthest past it)
    rel_diff: float = math.nan  # worst_param: |layout - T| / |T|
    ref_rel_diff: float = math.nan  # worst_param: |one process - T| / |T| (0 without float64)
    tensors_ok: bool = True
    zero_gradient: list[str] = field(default_factory=list)
    seconds: float = math.nan
    error: str = ""
    tol: float = 1e-5

    @property
    def ok(self) -> bool:
        return not self.error and self.tensors_ok and self.first_divergence is None

    def cells(self) -> list[str]:
        if self.error:
            return [self.layout, str(self.ranks)] + ["-"] * 6 + ["ERROR: " + self.error]
        step = "-" if self.first_divergence is None else str(self.first_divergence)
        if self.ok:
            result = "ok"
        elif self.first_divergence is not None:
            result = f"FAIL: diverges at step {self.first_divergence}"
        else:
            result = f"FAIL: {self.worst_param} beyond max(tol {self.tol:.0e}, {SLACK:g} x one process)"
        return [self.layout, str(self.ranks), f"{self.max_param_diff:.2e}",
                f"{self.max_loss_diff:.2e}", step, self.worst_param,
                f"{self.rel_diff:.1e} / {self.ref_rel_diff:.1e}", f"{self.seconds:.1f}", result]


HEADER = ["layout", "ranks", "max |dparam|", "max |dloss|", "diverges at step",
          "worst tensor", "rel. error: layout / 1 process", "seconds", "result"]


def _relative(x: torch.Tensor, truth: torch.Tensor) -> float:
    if not x.numel():
        return 0.0
    scale = truth.abs().max().item()
    return (x - truth).abs().max().item() / (scale if scale > 0 else 1.0)


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


def compare(reference: dict, run: dict, row: Row, truth: dict | None = None) -> Row:
    """Fill ``row`` from a layout's ``run`` against the fp32 one-process ``reference`` and, when
    given, the float64 one-process ``truth``."""
    want, got = reference["params"], run["params"]
    if sorted(want) != sorted(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        row.error = f"the layout's model has other parameters: missing {missing[:3]}, extra {extra[:3]}"
        return row
    shapes = [k for k in want if got[k].shape != want[k].shape]
    if shapes:
        row.error = f"parameter {shapes[0]} has shape {tuple(got[shapes[0]].shape)}, one process {tuple(want[shapes[0]].shape)}"
        return row
    losses, ref_losses = run["losses"], reference["losses"]
    if len(losses) != len(ref_losses):
        row.error = f"ran {len(losses)} steps, one process {len(ref_losses)}"
        return row
    row.max_param_diff = max(((got[k].double() - want[k].double()).abs().max().item()
                              for k in want if want[k].numel()), default=0.0)
    row.max_loss_diff = float((losses - ref_losses).abs().max()) if len(losses) else 0.0
    true = truth or reference
    row.zero_gradient = sorted(zero_gradient((truth or reference).get("grad_sizes", {})))
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
    bad = _diverged(losses, ref_losses, true["losses"], row.tol)
    norms = run["grad_norms"]
    # (a layout without a global norm, ps, records NaN: not a divergence)
    bad = bad | _diverged(norms, reference["grad_norms"], true["grad_norms"], row.tol, False)
    row.first_divergence = int(bad.nonzero()[0]) + 1 if bad.any() else None
    row.seconds = run["seconds"]
    return row


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
