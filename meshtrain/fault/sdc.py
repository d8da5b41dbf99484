"""Silent data corruption (SDC) check: ``sdc_check_every_n_steps=N``.

A faulty core or memory can return wrong numbers without any error: the loss stays finite, the
run goes on, the model is quietly damaged. Every N-th step each rank computes the gradient of
its first micro-batch a second time, with the same parameters, inputs and random state, and
compares the two bit for bit: deterministic kernels give the same bits, so any difference is
the hardware's (or a non-deterministic kernel's: on a GPU this needs
``torch.use_deterministic_algorithms(True)``).

* The step's own gradient of that micro-batch is read as backward produces it (a hook on each
  parameter, before it is accumulated and before DDP all-reduces it), reduced at once to one
  64-bit checksum per parameter (:func:`signatures`); nothing is kept but those numbers.
* The replay runs the model's plain forward (not the DDP wrapper: no collective) with the
  random state of the step's first forward, and ``torch.autograd.grad`` (``.grad`` untouched);
  model buffers and the random state are put back afterwards, so a checked run trains exactly
  as an unchecked one.
* A mismatch makes the step's flag say so; the ranks exchange it with the NaN/Inf flags and
  follow ``nan_policy`` (error, skip, rollback), naming the rank and the step.

Why a positional checksum, not XOR: an XOR of the words (torchtitan's) does not change when
elements trade places, so a corruption that permutes values (a wrong index, a swapped block)
passes. Here each 32-bit word w_i counts as w_i * (2i + 1), summed modulo 2**64: one flipped
bit changes the sum by 2**k * (2i + 1), never 0 modulo 2**64; two different values trading
places i < j change it by (w_i - w_j) * 2 (j - i), whose size stays below 2**64 for tensors of
fewer than 2**31 words, so it is never 0 either. Other differences go unseen only when their
changes cancel modulo 2**64. Cost: three passes over each gradient on checked steps.

Where: one process, and plain data parallel (``dp``, ``zero1``), where a rank's gradient of a
micro-batch is its own before the all-reduce; other layouts are refused at the start of fit.
"""

from __future__ import annotations

import functools

import torch

from meshtrain.errors import ConfigError


def signature(grad: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64: sum of the gradient's 32-bit (or 16-bit) words w_i times (2i + 1),
    modulo 2**64 (int64 arithmetic wraps)."""
    flat = grad.detach().reshape(-1)
    if flat.element_size() == 2:
        words = flat.view(torch.int16)
    else:  # 4 or 8 bytes: as 32-bit words
        words = flat.view(torch.int32)
    weights = torch.arange(1, 2 * words.numel() + 1, 2, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64) * weights).sum()


def check_layout(engine) -> None:
    """Refuse (ConfigError, on every rank alike) what the replay cannot check exactly."""
    layout = engine.layout
    where = None
    if not layout.gradients_identical_after_sync or layout.expert_degree > 1:
        where = f"layout {layout}"
    elif engine.step_call is not None:
        where = "a model with its own training_step"
    elif engine.averager is not None:
        where = "local SGD or parameter servers"
    elif engine.router_loss is not None and engine.router_loss.coef:
        where = "a model whose router loss meshtrain adds"
    if where is not None:
        raise ConfigError(
            f"sdc_check_every_n_steps replays a micro-batch on the rank that computed it, which "
            f"it can do in one process and under plain data parallel (dp, zero1) with a "
            f"loss_fn or a model returning its loss; not with {where}. Set "
            "sdc_check_every_n_steps=None, or check on such a layout")


class GradientReplay:
    """The check of one fit: :meth:`begin_step` every step, :meth:`capture` from the Engine
    before the step's first forward, :meth:`verify` before the update (the StepGuard)."""

    def __init__(self, engine, every_n_steps: int):
        check_layout(engine)
        self.engine, self.every = engine, every_n_steps
        self.due = False
        self.captured = False
        self._hooks: list = []
        self._first: dict[str, torch.Tensor] = {}
        engine.replay = self

    def begin_step(self, step: int) -> None:
        self.due = step % self.every == 0

    def capture(self, batch, items, accum: int) -> None:
        """(The Engine, before the step's first forward.) On a checked step: remember the first
        micro-batch, its scale, the random state and buffers the forward starts from, and read
        each parameter's first gradient of the step (that micro-batch's) as it is computed."""
        if not self.due:
            return
        self.due, self.captured = False, True
        self.batch, self.items, self.accum = batch, items, accum
        self.rng = _rng_state()
        self.buffers = {n: b.detach().clone() for n, b in self.engine.model.named_buffers()}
        self._first.clear()
        for name, param in self.engine.model.named_parameters():
            if param.requires_grad:
                self._hooks.append(param.register_hook(functools.partial(self._record, name)))

    def _record(self, name: str, grad: torch.Tensor) -> None:
        if name not in self._first:  # later calls: the step's other micro-batches
            self._first[name] = signature(grad)

    def verify(self) -> str | None:
        """After the step's backward: replay the first micro-batch; the first parameter whose
        gradient differs, or None (nothing checked this step: None too)."""
        if not self.captured:
            return None
        self.captured = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        engine, model = self.engine, self.engine.model
        after_rng = _rng_state()
        after = {n: b.detach().clone() for n, b in model.named_buffers()}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        try:
            _copy_buffers(model, self.buffers)
            _set_rng_state(self.rng)
            grads = self._replay([p for _, p in named])
        finally:
            _copy_buffers(model, after)
            _set_rng_state(after_rng)
        self.batch = self.items = self.buffers = self.rng = None
        for (name, _), grad in zip(named, grads):
            if grad is None or name not in self._first:
                continue  # not used by that micro-batch
            if not torch.equal(signature(grad), self._first[name]):
                return name
        return None

    def _replay(self, params: list) -> tuple:
        from meshtrain.parallel.data.batch_gather import batch_group
        from meshtrain.parallel.step_loss import compute_loss

        engine = self.engine
        batch = engine.shard(self.batch)
        with engine.loss_context(), engine.precision.autocast(), batch_group(engine.batch_pg):
            loss = compute_loss(engine.model, batch, engine.loss_fn, self.items is not None,
                                call_kwargs=engine.call_kwargs)
            loss = loss / self.accum if self.items is None else loss / self.items.divisor()
        return torch.autograd.grad(engine.precision.scale_loss(loss), params, allow_unused=True)


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@torch.no_grad()
def _copy_buffers(model: torch.nn.Module, values: dict) -> None:
    for name, buffer in model.named_buffers():
        if name in values:
            buffer.copy_(values[name])
