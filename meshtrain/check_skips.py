"""Checks that could not run say so: "checked before start" means checked, or a line says what
was not and why.

A check made before any process starts (the pipeline's stages against the model's forward,
context parallel's look at the attention, tp's local shapes, ...) calls :func:`skipped` when
it cannot judge (the model's forward fails on its stand-ins, the samples are not a tensor).
``Trainer.check`` / ``fit`` collect those lines (:func:`collecting`): ``fit`` prints them at
start, ``meshtrain train --dry-run`` under its config, ``Trainer.check`` returns them. Outside
a collection the line is a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

_NOTES: contextvars.ContextVar[list | None] = contextvars.ContextVar("meshtrain_check_skips",
                                                                     default=None)


class CheckSkipped(UserWarning):
    """A check before start that could not run (outside ``Trainer.check`` / ``fit``)."""


def skipped(check: str, why: str) -> None:
    """``check`` could not run, because ``why``: one line at start ("pipeline check skipped:
    ...")."""
    line = f"{check} skipped: {why}"
    notes = _NOTES.get()
    if notes is None:
        warnings.warn(line, CheckSkipped, stacklevel=2)
    elif line not in notes:
        notes.append(line)


@contextlib.contextmanager
def collecting():
    """Collect the :func:`skipped` lines of the block (yields the list); an enclosing
    collection gets them too, unless the block raised (a refusal says what matters)."""
    outer, notes = _NOTES.get(), []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)
    if outer is not None:
        outer.extend(n for n in notes if n not in outer)
