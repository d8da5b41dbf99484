"""Lightning's hooks on the module: the ones meshtrain calls, where (Lightning's order), and the
ones a module may not define because meshtrain would not call them (refused before start);
and a ``meshtrain.Callback`` written with Lightning's hooks (:func:`check_callback`).

Called on every rank, on the module ``fit`` trains: ``on_fit_start`` / ``on_train_start``,
``on_train_epoch_start``, ``on_train_epoch_end`` (after the epoch's validation; what it logs
is the epoch's), ``on_before_optimizer_step(optimizer)`` (gradients final), ``on_train_end`` /
``on_fit_end``; in ``validate`` / ``test`` (and fit's validation): ``on_validation_start``,
``on_validation_epoch_start``, ``on_validation_epoch_end`` (after the last batch, before the
values logged are reduced: it may log its own), ``on_validation_end``, and the same for test.
"""

from __future__ import annotations

import inspect

from meshtrain.errors import ConfigError

# a meshtrain callback hook -> the module's hooks called with it (after the callbacks')
WITH_CALLBACKS = {"on_fit_start": ("on_fit_start", "on_train_start"),
                  "on_train_epoch_start": ("on_train_epoch_start",),
                  "on_before_optimizer_step": ("on_before_optimizer_step",),
                  "on_fit_end": ("on_train_end", "on_fit_end")}
IN_EVALUATION = {stage: tuple(f"on_{stage}_{when}" for when in (
    "start", "epoch_start", "epoch_end", "end")) for stage in ("validation", "test")}
CALLED = {h for hooks in (*WITH_CALLBACKS.values(), *IN_EVALUATION.values()) for h in hooks} | {
    "on_train_epoch_end"}

_INSTEAD = "a Callback's on_train_step_start/on_train_step_end(trainer, ...)"
_STATE = ("a registered buffer (saved with the model) or a Callback's state_dict() / "
          "load_state_dict()")
_TRANSFER = "the dataset or a collate_fn (meshtrain moves tensors itself)"
_BACKWARD = "on_before_optimizer_step (gradients final there)"
_MANUAL = "automatic_optimization = False and step in training_step"
NOT_CALLED = {  # the hook -> what to use instead
    **dict.fromkeys(("on_train_batch_start", "on_train_batch_end"), _INSTEAD),
    **dict.fromkeys(("on_validation_batch_start", "on_validation_batch_end"), "validation_step"),
    **dict.fromkeys(("on_test_batch_start", "on_test_batch_end"), "test_step"),
    **dict.fromkeys(("on_before_backward", "on_after_backward", "on_before_zero_grad"),
                    _BACKWARD),
    **dict.fromkeys(("optimizer_step", "optimizer_zero_grad"), _MANUAL),
    **dict.fromkeys(("on_save_checkpoint", "on_load_checkpoint"), _STATE),
    **dict.fromkeys(("on_predict_start", "on_predict_end", "on_predict_epoch_start",
                     "on_predict_epoch_end"), "predict_step"),
    **dict.fromkeys(("on_before_batch_transfer", "on_after_batch_transfer",
                     "transfer_batch_to_device"), _TRANSFER),
    "configure_callbacks": "Trainer(callbacks=[...])", "teardown": "on_fit_end",
}
_BASES = ("ModelHooks.", "CheckpointHooks.", "DataHooks.", "LightningModule.",
          "TrainingModule.", "Module.")


def defines(model, hook: str) -> bool:
    """Does ``model``'s class define ``hook`` (not Lightning's or torch's placeholder)?"""
    method = getattr(type(model), hook, None)
    return callable(method) and not getattr(method, "__qualname__", "").startswith(_BASES)


def check_hooks(model, pp: int) -> None:
    """Before start: no hook meshtrain would not call; none at all under ``pp`` (a pipeline
    splits the module into stages: a hook would run on each stage's part)."""
    name = type(model).__name__
    for hook, instead in NOT_CALLED.items():
        if defines(model, hook):
            raise ConfigError(f"{name}.{hook} is a Lightning hook meshtrain does not call (it "
                              f"runs a step as micro-batches over the ranks); use {instead}")
    if pp > 1:
        used = sorted(h for h in CALLED if defines(model, h))
        if used:
            raise ConfigError(f"{name} defines {', '.join(used)}: under pp the module is split "
                              "into stages and its hooks are not called; use a Callback "
                              "(Trainer(callbacks=[...])) or a layout without pp")


def call(model, hooks, *args) -> None:
    """Each of ``hooks`` that ``model`` defines, with ``args``."""
    for hook in hooks:
        if model is not None and defines(model, hook):
            getattr(model, hook)(*args)


def after_callbacks(trainer, hook: str) -> None:
    """The module's hooks that go with the callbacks' ``hook`` (Trainer._call)."""
    args = (trainer.optimizer,) if hook == "on_before_optimizer_step" else ()
    call(trainer.model, WITH_CALLBACKS.get(hook, ()), *args)


def at_epoch_end(trainer) -> None:
    """The module's ``on_train_epoch_end``: what it logs is the epoch's (Lightning's default
    there), so it goes out with the epoch's values."""
    logs = trainer._logs
    logs.at_epoch_end = True
    try:
        call(trainer.model, ("on_train_epoch_end",))
    finally:
        logs.at_epoch_end = False


# Lightning's callback hooks that are not meshtrain's: a subclass defining one would never be
# called (check_callback refuses it, naming meshtrain's nearest)
_LIGHTNING_HOOKS = {
    **dict.fromkeys(("on_train_batch_start", "on_train_batch_end"),
                    "on_train_step_start(trainer) / on_train_step_end(trainer, metrics)"),
    **dict.fromkeys(("on_validation_epoch_start", "on_validation_batch_start"),
                    "on_validation_start(trainer)"),
    **dict.fromkeys(("on_validation_epoch_end", "on_validation_batch_end"),
                    "on_validation_end(trainer, metrics)"),
    "on_train_start": "on_fit_start(trainer)", "on_train_end": "on_fit_end(trainer)",
    **dict.fromkeys(("on_before_backward", "on_after_backward", "on_before_zero_grad"),
                    "on_before_optimizer_step(trainer)"),
    **dict.fromkeys(("on_save_checkpoint", "on_load_checkpoint"),
                    "state_dict() / load_state_dict(state)"),
    **dict.fromkeys(("on_test_start", "on_test_end", "on_test_epoch_start",
                     "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
                     "on_predict_start", "on_predict_end", "on_sanity_check_start",
                     "on_sanity_check_end", "teardown"), None),
}


def check_callback(callback) -> None:
    """Before start: every hook the callback overrides is called with meshtrain's arguments
    (Lightning's ``(trainer, pl_module)`` would fail there: the module is ``trainer.model``),
    and none is a Lightning hook meshtrain never calls."""
    from meshtrain.callbacks import Callback

    kind = type(callback).__name__
    for name, method in inspect.getmembers(type(callback), inspect.isfunction):
        if name in _LIGHTNING_HOOKS:
            instead = _LIGHTNING_HOOKS[name]
            raise ConfigError(f"{kind}.{name} is a Lightning callback hook that meshtrain never "
                              "calls; " + (f"use {instead}" if instead else "meshtrain has no "
                                           "such point (test and predict run no callbacks)"))
        base = getattr(Callback, name, None)
        if base is None or method is base or not name.startswith("on_"):
            continue
        wants = list(inspect.signature(base).parameters)[1:]  # after self
        try:
            inspect.signature(method).bind(callback, *wants)
        except TypeError:
            raise ConfigError(
                f"{kind}.{name}{inspect.signature(method)}: meshtrain calls "
                f"{name}({', '.join(wants)}) (Lightning's pl_module is trainer.model)") from None
