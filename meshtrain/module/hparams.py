"""A module's hyper-parameters as Lightning saves them: ``self.save_hyperparameters()`` in
``__init__`` keeps its arguments in ``self.hparams`` (read as ``self.hparams.lr``), and the
loggers record them with the run's settings."""

from __future__ import annotations

import inspect
from argparse import Namespace

from meshtrain.errors import ConfigError


class AttributeDict(dict):
    """A dict whose keys read as attributes (Lightning's ``AttributeDict``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyper-parameter {name!r}; saved: {', '.join(self)}") \
                from None

    def __setattr__(self, name: str, value) -> None:
        self[name] = value


def init_arguments(frame) -> dict:
    """The named arguments of the ``__init__`` running in ``frame``, its ``**kwargs`` spread."""
    info = inspect.getargvalues(frame)
    values = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
    if info.keywords:
        values.update(info.locals.get(info.keywords) or {})
    return values


def collect(frame, args: tuple, ignore) -> AttributeDict:
    """What ``save_hyperparameters(*args, ignore=...)`` called from ``frame`` keeps: every
    ``__init__`` argument, those named in ``args``, or one dict / Namespace given in ``args``."""
    if len(args) == 1 and isinstance(args[0], (dict, Namespace)):
        given = args[0]
        return AttributeDict(vars(given) if isinstance(given, Namespace) else given)
    values = init_arguments(frame)
    unknown = [a for a in args if not isinstance(a, str) or a not in values]
    if unknown:
        raise ConfigError(f"save_hyperparameters({', '.join(map(repr, args))}): "
                          f"{', '.join(map(repr, unknown))} is not an argument of __init__ "
                          f"(its arguments: {', '.join(values) or 'none'})")
    if args:
        values = {name: values[name] for name in args}
    dropped = [ignore] if isinstance(ignore, str) else list(ignore or ())
    return AttributeDict({k: v for k, v in values.items() if k not in dropped})


def logged(model) -> dict:
    """What the loggers record of ``model``'s saved hyper-parameters (``hparams/<name>``: the
    numbers, strings, booleans and None); nothing for ``logger=False`` or another object."""
    saved = getattr(model, "__dict__", {}).get("_hparams")
    if not saved or not model.__dict__.get("_log_hparams", True):
        return {}
    return {f"hparams/{k}": v for k, v in saved.items()
            if v is None or isinstance(v, (bool, int, float, str))}


def checkpointed(model) -> dict:
    """What a checkpoint keeps of ``model``'s saved hyper-parameters (those JSON holds as they
    are) for ``load_from_checkpoint``; an object among them is given again there."""
    saved = getattr(model, "__dict__", {}).get("_hparams") or {}
    return {k: v for k, v in saved.items() if _json_plain(v)}


def _json_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_plain(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _json_plain(v)
                                           for k, v in value.items())


def load_from_checkpoint(cls, checkpoint_path, map_location=None, strict: bool = True,
                         **kwargs):
    """``cls`` built from the hyper-parameters saved with the checkpoint (``kwargs`` add to or
    replace them), holding the checkpoint's weights whole, in this one process."""
    import json
    from pathlib import Path

    from meshtrain.checkpoint.safe_load import read_model_state
    from meshtrain.checkpoint.state import SUMMARY

    summary = Path(checkpoint_path) / SUMMARY
    saved = json.loads(summary.read_text()).get("module_hparams", {}) if summary.is_file() \
        else {}
    try:
        model = cls(**{**saved, **kwargs})
    except TypeError as error:
        raise ConfigError(f"{cls.__name__}.load_from_checkpoint: building {cls.__name__}(**"
                          f"{sorted({**saved, **kwargs})}) failed ({error}); the checkpoint "
                          "keeps only the plain hyper-parameters: give the others as "
                          "keywords") from None
    state = read_model_state(checkpoint_path)
    if map_location is not None:
        state = {k: v.to(map_location) for k, v in state.items()}
    model.load_state_dict(state, strict=strict)
    return model
