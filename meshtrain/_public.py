"""The public Python API: the modules users import from, and their part of docs/reference.md.

Each module in :data:`PUBLIC_MODULES` is the path to write, whatever file defines a name (as
Lightning documents ``lightning.pytorch.callbacks``, never the file inside it): its ``__all__``
is what it offers. docs/reference.md lists them, then the old paths of moved modules
(meshtrain/_graveyard.py); ``python tools/gen_reference.py`` writes the whole file
(:func:`reference_document`), tests/test_settings.py checks it is current and
tests/test_public_api.py that its lists are the modules' ``__all__``.
"""

from __future__ import annotations

import importlib
import inspect

from meshtrain._graveyard import MOVED

PUBLIC_MODULES = (
    "meshtrain",                   # Trainer, callbacks, errors, Layout, TrainingModule, ...
    "meshtrain.losses",            # losses that average over the global batch
    "meshtrain.metrics",           # validation metrics reduced over every rank
    "meshtrain.models",            # meshtrain's GPT (and MoE GPT); Hugging Face model factories
    "meshtrain.optim",             # optimizer factories that see parameter names
    "meshtrain.packing",           # packed documents: masks, positions, targets
    "meshtrain.parallel.context",  # cp_attention and the sequence split, for a model's own cp
    "meshtrain.parallel.tensor",   # tp plan helpers and styles, for a tp_plan of your own
    "meshtrain.sweep",             # hyperparameter sweeps from Python
)

API_HEADING = "## Public Python API"


def _one_line(text: str | None) -> str:
    first = (text or "").strip().split("\n\n")[0]
    return " ".join(first.split()).replace("|", "\\|")


def _summary(value) -> tuple[str, str]:
    """(kind, the first paragraph of its docstring) of an exported value."""
    if inspect.ismodule(value):
        return "module", _one_line(value.__doc__)
    if inspect.isclass(value):
        doc = inspect.getdoc(value) or ""
        if doc.startswith(f"{value.__name__}("):  # a dataclass's generated signature
            doc = ""
        return "class", _one_line(doc)
    if callable(value):
        return "function", _one_line(inspect.getdoc(value))
    return type(value).__name__, ""


def api_markdown() -> str:
    """The Public Python API and Moved modules sections of docs/reference.md."""
    out = [API_HEADING, "",
           "<!-- Generated from each module's `__all__` (meshtrain/_public.py) by "
           "`python tools/gen_reference.py`; do not edit by hand. -->", "",
           "Import from these modules: `from meshtrain.parallel.tensor import attention_plan` "
           "is the path to write, whatever file defines the name inside, and it stays when "
           "files move. Each module's names are its `__all__`.", ""]
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        out += [f"### `{name}`", "", _one_line(module.__doc__), "",
                "| name | kind | what it is |", "|---|---|---|"]
        for export in module.__all__:
            kind, summary = _summary(getattr(module, export))
            out.append(f"| `{export}` | {kind} | {summary} |")
        out.append("")
    out += ["## Moved modules", "",
            "Old import paths that still work: importing one gives the module it became (the "
            "same module object) and warns once with a `DeprecationWarning` naming the new "
            "path (meshtrain/_graveyard.py). Import from the public module where there is one.",
            "", "| old path | now | public names from |", "|---|---|---|"]
    for old, (new, public) in MOVED.items():
        out.append(f"| `{old}` | `{new}` | {f'`{public}`' if public else ''} |")
    out.append("")
    return "\n".join(out)


def reference_document() -> str:
    """The text of docs/reference.md: the settings and callbacks, then the Python API."""
    from meshtrain.settings import reference_markdown

    return reference_markdown().rstrip("\n") + "\n\n" + api_markdown()
