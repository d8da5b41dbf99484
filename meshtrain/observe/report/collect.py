"""A run folder read into one :class:`Run`: what the run wrote, and sentences on what it did not.

The files and their readers are :mod:`meshtrain.observe.run_files`'s. A run killed mid-way
leaves a last line cut short in an appended file (``metrics.csv``, ``breakdown.csv``,
``events.jsonl``): that line is left out and said so in ``missing``.
"""

from __future__ import annotations

import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.errors import ConfigError
from meshtrain.observe import run_files
from meshtrain.observe.loggers import read_metrics_csv

RUN_MARKERS = ("config.toml", "metrics.csv", run_files.ENVIRONMENT)


@dataclass
class Run:
    path: Path
    name: str
    status: str  # environment.json's (observe/ending.py), "running or killed", or "unknown"
    error: str | None
    config: dict  # config.toml as read (None settings are absent)
    settings: list[tuple[str, str, str]]  # (section, key, value as TOML), None ones included
    environment: dict
    metrics: list[dict]  # read_metrics_csv's rows
    breakdown: list[dict]  # run_files.read_breakdown's rows
    events: list[dict]  # run_files.read_events', each with "found": its path exists
    pipeline: dict | None
    memory_text: str | None
    traces: list[str]  # paths relative to the run folder
    checkpoints: list[str]  # checkpoints/<name> folders, relative to the run folder
    missing: list[str] = field(default_factory=list)
    experts: list[dict] = field(default_factory=list)  # run_files.read_expert_load's rows

    @property
    def has_pipeline_layout(self) -> bool:
        layout = str(self.environment.get("layout")
                     or self.config.get("trainer", {}).get("layout") or "")
        return any(int(d) > 1 for d in re.findall(r"\bpp\s*=\s*(\d+)", layout))


def collect(run_dir) -> Run:
    """Everything ``run_dir`` holds for the report; a ConfigError when it is not a run folder."""
    path = Path(run_dir)
    _check_run_dir(path)
    missing: list[str] = []
    environment = _read_environment(path, missing)
    config, settings = _read_config(path, missing, environment.get("settings"))
    status, error = _status(environment, missing)
    run = Run(
        path=path,
        name=str(config.get("logging", {}).get("name") or path.resolve().parent.name),
        status=status, error=error, config=config, settings=settings,
        environment=environment,
        metrics=_read_metrics(path, missing),
        breakdown=_read_appended(path, run_files.BREAKDOWN, run_files.read_breakdown,
                                 missing),
        events=[e for e in _read_appended(path, run_files.EVENTS, run_files.read_events,
                                          missing) if isinstance(e, dict)],
        pipeline=run_files.read_json(path / run_files.PIPELINE),
        memory_text=_read_text(path / "memory.txt"),
        traces=sorted((p.relative_to(path).as_posix() for p in path.glob("traces/*.json")),
                      key=lambda p: (len(p), p)),
        checkpoints=sorted(p.relative_to(path).as_posix()
                           for p in path.glob("checkpoints/*") if p.is_dir()),
        missing=missing,
        experts=run_files.read_expert_load(path),
    )
    _note_missing(run)
    return run


def _check_run_dir(path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"run folder {path} does not exist; runs are under "
                          "root_dir/<name>/<timestamp> (e.g. runs/char_gpt/20261126-120036)")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a run folder; pass the folder a run wrote, "
                          "root_dir/<name>/<timestamp> (e.g. runs/char_gpt/20261126-120036)")
    if any((path / marker).exists() for marker in RUN_MARKERS):
        return
    runs = sorted({p.parent for marker in RUN_MARKERS
                   for pattern in (f"*/{marker}", f"*/*/{marker}") for p in path.glob(pattern)})
    hint = (f"; it holds runs, the latest {runs[-1]}" if runs else "")
    raise ConfigError(
        f"{path} is not a run folder: it has none of {', '.join(RUN_MARKERS)}. A run writes "
        f"them in its folder, root_dir/<name>/<timestamp> (e.g. runs/char_gpt/20261126-120036)"
        f"{hint}"
    )


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _read_config(path: Path, missing: list[str],
                 recorded: dict | None = None) -> tuple[dict, list[tuple[str, str, str]]]:
    """config.toml (``meshtrain train``), else the settings the Trainer recorded in
    environment.json (a Trainer used from Python), by section."""
    text = _read_text(path / "config.toml")
    if text is None and isinstance(recorded, dict):
        from meshtrain.config import toml_value
        from meshtrain.settings import SETTINGS

        config: dict = {}
        for key, value in recorded.items():
            section = SETTINGS[key].section if key in SETTINGS else "run"
            config.setdefault(section, {})[key] = value
        return config, [(section, key, "none" if value is None else toml_value(value))
                        for section, values in config.items() for key, value in values.items()]
    if text is None:
        missing.append("no config.toml: the settings were not saved (a recipe run by "
                       "`meshtrain train` writes them; a Trainer used from Python does not)")
        return {}, []
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        missing.append(f"config.toml cannot be read as TOML ({error})")
        return {}, []
    return config, _settings(config, text)


def _settings(config: dict, text: str) -> list[tuple[str, str, str]]:
    """Every setting as (section, key, TOML value); config.toml writes a None setting as a
    comment, ``# key = none``, and it is listed as ``none`` at the end of its section."""
    from meshtrain.config import toml_value

    rows = [(section, key, toml_value(value)) for section, values in config.items()
            if isinstance(values, dict) for key, value in values.items()]
    rows += [("", key, toml_value(value)) for key, value in config.items()
             if not isinstance(value, dict)]
    section = ""
    for line in text.splitlines():
        if header := re.fullmatch(r"\s*\[([^\]]+)\]\s*", line):
            section = header[1].strip()
        elif unset := re.fullmatch(r"\s*#\s*([\w-]+)\s*=\s*none\s*", line):
            at = max((i + 1 for i, row in enumerate(rows) if row[0] == section), default=0)
            rows.insert(at, (section, unset[1], "none"))
    return rows


def _read_environment(path: Path, missing: list[str]) -> dict:
    environment = run_files.read_json(path / run_files.ENVIRONMENT)
    if environment is None:
        missing.append(
            f"no readable {run_files.ENVIRONMENT}: where the run ran and how it ended are not "
            "known (a run writes it when it starts)"
            if not (path / run_files.ENVIRONMENT).exists() else
            f"{run_files.ENVIRONMENT} is not a JSON object: where the run ran and how it ended "
            "are not known")
    return environment or {}


def _status(environment: dict, missing: list[str]) -> tuple[str, str | None]:
    status = environment.get("status")
    ending = environment.get("ending") if isinstance(environment.get("ending"), dict) else {}
    if status in ("failed", "stopped_by_watchdog", "killed"):
        cause = str(environment.get("error") or ending.get("cause")
                    or "no error message recorded")
        if ending.get("rank") is not None:
            cause = f"rank {ending['rank']}: {cause}"
        return status, cause
    if status in ("finished", "preempted"):
        return status, None
    if status == "running" and not environment.get("finished"):
        missing.append(f"{run_files.ENVIRONMENT} says \"running\" and has no finish time: the "
                       "run is still going, or it was killed (a kill leaves no failure "
                       "record); what it did after its last write is not here")
        return "running or killed", None
    return "unknown", None


def _whole_lines(path: Path, name: str, reader, missing: list[str]):
    """``reader(folder)`` on ``path/name`` with a last line cut short by a kill (a file not
    ending in a newline) left out, and said so in ``missing``."""
    data = (path / name).read_bytes()
    if not data or data.endswith(b"\n"):
        return reader(path)
    missing.append(f"{name}'s last line was cut short (the run was killed while writing it); "
                   "it is left out")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_bytes(data[:data.rfind(b"\n") + 1])
        return reader(Path(tmp))


def _read_appended(path: Path, name: str, reader, missing: list[str]) -> list[dict]:
    if not (path / name).exists():
        return []
    try:
        return _whole_lines(path, name, reader, missing)
    except (OSError, ValueError) as error:
        missing.append(f"{name} cannot be read ({error})")
        return []


def _read_metrics(path: Path, missing: list[str]) -> list[dict]:
    if not (path / "metrics.csv").exists():
        missing.append("no metrics.csv: the run logged no metrics (no \"csv\" in "
                       "logging.loggers, or it stopped before its first logging interval)")
        return []
    return _read_appended(path, "metrics.csv",
                          lambda folder: read_metrics_csv(folder / "metrics.csv"), missing)


def setting(run: Run, key: str):
    """A setting as the run recorded it (config.toml, else environment.json), or None."""
    for values in run.config.values():
        if isinstance(values, dict) and key in values:
            return values[key]
    return None


_PERIODIC = re.compile(r"checkpoints/step_(\d+)")


def removed_on_purpose(run: Run) -> dict[str, str]:
    """{path: why} for the checkpoint folders the run's events name that the run itself
    deleted: a ``removed`` event's (a best-k checkpoint a better one replaced), and the
    periodic ``checkpoints/step_*`` folders ``keep_last_k`` rotated away: the checkpoint
    writer keeps the newest k, so a periodic folder is gone by rotation once k newer ones were
    saved after it."""
    removed = {e["path"]: str(e.get("message") or "removed by the run")
               for e in run.events if e.get("kind") == "removed" and e.get("path")}
    keep = setting(run, "keep_last_k")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        return removed
    saved = sorted({int(m[1]): e["path"] for e in run.events if e.get("kind") == "checkpoint"
                    and (m := _PERIODIC.fullmatch(str(e.get("path") or "")))}.items())
    for index, (_, path) in enumerate(saved):
        if len(saved) - index - 1 >= keep:
            removed.setdefault(path, f"rotated away by keep_last_k = {keep} (the newest {keep} "
                                     "periodic checkpoints are kept)")
    return removed


def has_values(rows: list[dict], key: str) -> bool:
    return any(row.get(key) is not None for row in rows)


def _note_missing(run: Run) -> None:
    """Sentences for the pieces a complete run has and this one lacks."""
    say = run.missing.append
    if run.metrics and not (has_values(run.metrics, "train/loss")
                            or has_values(run.metrics, "val/loss")):
        say("metrics.csv has no train/loss or val/loss values")
    if run.metrics and not any(has_values(run.metrics, f"train/{u}_per_s")
                               for u in ("tokens", "samples")):
        say("metrics.csv has no throughput (train/tokens_per_s or train/samples_per_s)")
    if run.metrics and not has_values(run.metrics, "train/mfu"):
        say("metrics.csv has no train/mfu: MFU needs the model's FLOPs per token or sample "
            "and a known peak (environment.json's peak_tflops)")
    if not (run.path / run_files.BREAKDOWN).exists():
        say(f"no {run_files.BREAKDOWN}: the run stopped before its first logging interval "
            "(or its meshtrain did not write one)")
    elif not run.breakdown:
        say(f"{run_files.BREAKDOWN} has no complete row with the columns "
            f"{', '.join(run_files.BREAKDOWN_COLUMNS)}")
    if run.has_pipeline_layout and run.pipeline is None:
        say(f"no readable {run_files.PIPELINE}: the pipeline run stopped before it recorded a "
            "step's schedule")
    if run.memory_text is None:
        say("no memory.txt: the run stopped before the end of its first step")
    removed = removed_on_purpose(run)
    for event in run.events:
        target = event.get("path")
        event["found"] = bool(target) and (run.path / target).exists()
        event["removed"] = None if event["found"] else removed.get(target)
        if target and not event["found"] and not event["removed"]:
            say(f"{target} (named by a {event.get('kind')} event at step {event.get('step')}) "
                "is not in the run folder, and the run did not remove it (not rotated away by "
                "keep_last_k, nor replaced by a better best-k checkpoint): it was deleted or "
                "moved since, or never written whole")
