"""docs/reference.md and the Trainer's ``Args:`` block, written from :mod:`meshtrain.settings`
(every Trainer setting) and the public callbacks' signatures with :data:`CALLBACK_ARGS` (their
one-line docs). ``python tools/gen_reference.py`` writes the file; a test keeps it current."""

from __future__ import annotations

import inspect
import textwrap

from meshtrain.config import toml_value
from meshtrain.settings.kinds import need_words
from meshtrain.settings import SECTIONS, SETTINGS, Setting

# The public callbacks' arguments, one line each; defaults and types come from the signatures
# (tests/test_settings.py fails when a parameter has no line here, or a line no parameter).
CALLBACK_ARGS: dict[str, dict[str, str]] = {
    "SWA": {
        "start_step": "The first optimizer step whose weights join the average.",
        "swap_at_end": "The model fit returns holds the average.",
    },
    "EMA": {
        "decay": "The weight of the old average at each step (between 0 and 1).",
        "use_for_validation": "Validate inside fit with the averaged weights.",
    },
    "EarlyStopping": {
        "monitor": "The validation metric to watch (a key of the validation metrics).",
        "patience": "Stop after this many validations without improvement (at least 1).",
        "mode": '"min": lower is better; "max": higher is better.',
        "min_delta": "An improvement must beat the best value by more than this.",
        "check_finite": "Stop at a NaN or infinite value.",
        "stopping_threshold": "Stop once the value is this good; none: not.",
        "divergence_threshold": "Stop once the value is worse than this; none: not.",
        "strict": "A validation without the value is an error (False: skipped).",
        "verbose": "Lightning's; changes nothing (the stop is always said).",
    },
    "ModelCheckpoint": {
        "dirpath": "Where checkpoints go; none: run_dir/checkpoints.",
        "monitor": "The validation metric that ranks checkpoints; none: no best-k checkpoints.",
        "mode": '"min": lower is better; "max": higher is better.',
        "save_top_k": "Keep the best k checkpoints by monitor (best_step_*; 0: none).",
        "save_last": "Save checkpoints/last at the end of fit.",
        "every_n_steps": "Also save step_* every N optimizer steps; none: not.",
        "every_n_train_steps": "Lightning's name for every_n_steps.",
        "filename": "Lightning's; refused (meshtrain names the folders).",
        "save_weights_only": "Lightning's; refused (a checkpoint holds the training state).",
        "every_n_epochs": "Lightning's; 1 or none (Trainer(checkpoint_every_n_epochs=N)).",
        "verbose": "Lightning's; changes nothing.",
    },
    "LearningRateMonitor": {
        "logging_interval": '"step" (none: the same) or "epoch": when the rates are logged.',
        "log_momentum": "Also log momentum (SGD's, or Adam's first beta).",
        "log_weight_decay": "Also log weight_decay.",
    },
}

_TYPE_TEXT = {
    "number": "number > 0", "bool": "bool", "str": "string", "path": "path",
    "devices": 'integer or "auto"', "layout": "layout string or table",
    "int_list": "list of integers", "steps": "list of step numbers", "callbacks": "list of Callback", "callable": "function",
    "tp_plan": "dict (module name -> ParallelStyle)", "resume": '"auto", a path',
    "metrics": "list of metric names",
}


def type_text(s: Setting) -> str:
    """The type column: ``int ≥ 1 or none``, ``one of "gpipe", "1f1b", ...``."""
    if s.type == "choice":
        text = ", ".join(toml_value(c) for c in s.choices)
        text = "one of " + text if len(s.choices) > 2 else text.replace(", ", " or ")
    elif s.type == "int":
        text = {1: "int ≥ 1", 0: "int ≥ 0"}.get(s.minimum, "int")
    elif s.type == "loggers":
        text = "list of " + " / ".join(toml_value(c) for c in s.choices)
    else:
        text = _TYPE_TEXT[s.type]
    return text + (" or none" if s.none else "")


def needs_text(s: Setting) -> str:
    """The needs column: every need in words, "and" between them; empty for none."""
    return " and ".join(need_words(need) for need in s.needs)


def default_text(s: Setting) -> str:
    return "[]" if s.type == "callbacks" else toml_value(s.default)


def public_callbacks() -> dict[str, type]:
    """The callback classes ``meshtrain`` exports, by name (Callback itself left out)."""
    import meshtrain
    from meshtrain.callbacks import Callback

    found = {name: getattr(meshtrain, name) for name in meshtrain.__all__}
    return {name: obj for name, obj in found.items()
            if isinstance(obj, type) and issubclass(obj, Callback) and obj is not Callback}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(*cells: str) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def reference_markdown() -> str:
    """The text of docs/reference.md: every setting by section, then the callbacks' arguments."""
    out = [
        "# Settings reference",
        "",
        "<!-- Generated from meshtrain/settings/table.py by `python tools/gen_reference.py`; "
        "do not edit by hand. -->",
        "",
        "Every `Trainer` keyword argument. In a recipe's TOML config each one lives in the "
        "section named below (`[trainer]`, `[parallel]`, ...) and can be overridden on the "
        "command line as `--section.name=value`; `meshtrain train CONFIG --dry-run` prints them "
        "all with their values and checks them. `none` is Python's `None`: in TOML (which has "
        'no null) write the string `"none"`. Settings marked *Python only* are objects a '
        "config file cannot hold: pass them to `Trainer(...)` in Python.",
        "",
        "*Needs* is what a setting needs to have any effect: an axis of the layout, a kind of "
        "layout, or another setting. A setting set to anything but its default while a need is "
        "unmet would do nothing, so the Trainer refuses it (before any process starts) with "
        "the fix; `meshtrain parity` leaves it out of the runs whose layout lacks it.",
        "",
    ]
    header = ["| name | type | default | doc |", "|---|---|---|---|"]
    for section, doc in SECTIONS.items():
        out += [f"## [{section}]", "", doc[0].upper() + doc[1:] + ".", "",
                "| name | type | default | needs | doc |", "|---|---|---|---|---|"]
        for s in SETTINGS.values():
            if s.section == section:
                doc_text = s.doc if s.config else f"*Python only.* {s.doc}"
                out.append(_row(f"`{s.name}`", type_text(s), f"`{default_text(s)}`",
                                needs_text(s), doc_text))
        out.append("")
    out += ["## Callbacks", "",
            "Passed as `Trainer(callbacks=[...])` (Python only), from `meshtrain`.", ""]
    for name, cls in public_callbacks().items():
        summary = inspect.getdoc(cls).split("\n\n")[0].replace("\n", " ")
        out += [f"### {name}", "", summary, ""]
        params = list(inspect.signature(cls).parameters.values())
        if not params:
            out += ["No arguments.", ""]
            continue
        out += header
        docs = CALLBACK_ARGS.get(name, {})
        for p in params:
            kind = p.annotation if isinstance(p.annotation, str) else getattr(
                p.annotation, "__name__", str(p.annotation))
            default = toml_value(p.default) if p.default is not p.empty else "(required)"
            doc_text = docs.get(p.name, "UNDOCUMENTED: add it to CALLBACK_ARGS in "
                                        "meshtrain/settings/reference.py")
            out.append(_row(f"`{p.name}`", kind.replace("None", "none"), f"`{default}`",
                            doc_text))
        out.append("")
    return "\n".join(out)


def docstring() -> str:
    """An ``Args:`` block for the Trainer's docstring, by section (defaults as Python)."""
    lines = ["Args:"]
    for s in SETTINGS.values():  # ordered by section
        where = f"config [{s.section}]" if s.config else "Python only"
        kind = type_text(s).replace(" or none", " or None")
        needs = f"; needs {needs_text(s)}" if s.needs else ""
        text = f"{s.name}: {s.doc} ({kind}; default {s.default!r}{needs}; {where})"
        lines += textwrap.wrap(text, width=96, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


def help_text(config: dict | None = None) -> str:
    """The settings a config can hold, by section, for ``meshtrain train --help``: each as
    ``--section.key`` with its default (or, given a resolved ``config``, its value there; a
    recipe's own sections too) and the first sentence of its doc."""
    import re
    import textwrap

    from meshtrain.settings import SETTINGS

    lines = []
    sections = config if config is not None else {s.section: {} for s in SETTINGS.values()}
    for section, values in sections.items():
        lines.append(f"[{section}]")
        known = [s for s in SETTINGS.values() if s.section == section and s.config]
        names = [s.name for s in known] + [k for k in values if k not in SETTINGS]
        for name in names:
            setting = SETTINGS.get(name)
            value = toml_value(values[name]) if name in values else default_text(setting)
            what = "value" if config is not None else "default"
            lines.append(f"  --{section}.{name}  ({what}: {value})")
            if setting is not None:
                first = re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z])", setting.doc)[0]
                first = first.rstrip(".") + "."
                lines += textwrap.wrap(first, 92, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines)
