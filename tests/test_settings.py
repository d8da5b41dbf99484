"""Settings defined once (meshtrain/settings/): every Trainer keyword has one definition whose
check rejects a bad value by name; configs, overrides, the reference and the docstring follow."""

import ast
import inspect
import re
import tomllib
from pathlib import Path

import pytest

import meshtrain
from meshtrain import Trainer, settings
from meshtrain.settings import reference
from meshtrain.config import dumps_toml, resolve
from meshtrain.errors import ConfigError
from meshtrain.settings.kinds import at_default
from meshtrain.settings import SECTIONS, SETTINGS

ROOT = Path(__file__).resolve().parents[1]
PYTHON_ONLY = {"callbacks", "blocks", "tp_plan"}


def _trainer_parameters() -> dict[str, inspect.Parameter]:
    """Trainer.__init__'s named keyword parameters (none when it takes ``**settings``)."""
    return {name: p for name, p in inspect.signature(Trainer.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _trainer_takes_any_keyword() -> bool:
    return any(p.kind == p.VAR_KEYWORD
               for p in inspect.signature(Trainer.__init__).parameters.values())


def test_every_trainer_keyword_is_defined_once_with_its_default():
    params = _trainer_parameters()
    assert set(params) <= set(SETTINGS), (
        "Trainer keywords missing from meshtrain/settings/table.py: "
        f"{sorted(set(params) - set(SETTINGS))}")
    if not _trainer_takes_any_keyword():
        assert set(SETTINGS) == set(params), (
            f"not a Trainer keyword: {sorted(set(SETTINGS) - set(params))}")
    for name, param in params.items():
        assert SETTINGS[name].default == param.default, name
    for name, setting in SETTINGS.items():
        assert setting.section in SECTIONS and setting.doc.strip(), name
        setting.validate(setting.default)  # every default passes its own check
    # ordered by section
    order = [SETTINGS[name].section for name in SETTINGS]
    assert order == sorted(order, key=list(SECTIONS).index)
    assert settings.defaults() == {name: s.default for name, s in SETTINGS.items()}


def test_the_trainer_takes_every_setting_by_its_name():
    trainer = Trainer(**{**settings.defaults(), "max_steps": 1})  # no process group is created
    assert trainer.world_size == 1


def test_sections_hold_every_config_setting_and_python_only_ones_are_marked():
    assert list(SECTIONS) == ["trainer", "parallel", "pipeline", "checkpoint", "fault", "logging"]
    assert {name for name, s in SETTINGS.items() if not s.config} == PYTHON_ONLY
    sections = settings.config_sections()
    assert list(sections) == list(SECTIONS)
    flat = [name for values in sections.values() for name in values]
    assert sorted(flat) == sorted(set(SETTINGS) - PYTHON_ONLY)
    assert sections["logging"]["loggers"] == ["csv", "tensorboard"]  # TOML has arrays, not tuples
    expected = {
        "pipeline": {"pp_schedule", "stages_per_rank", "pp_balance", "split_points"},
        "checkpoint": {"checkpoint_every_n_steps", "checkpoint_every_n_epochs",
                       "checkpoint_every_n_minutes", "keep_last_k",
                       "async_checkpoint", "resume", "init_from", "save_final_checkpoint",
                       "stop_on_signal"},
        "fault": {"nan_policy", "collective_timeout_s", "init_timeout_s", "stall_timeout_s",
                  "debug_collectives", "mtbf_hours", "sdc_check_every_n_steps"},
    }
    for section, names in expected.items():
        assert set(sections[section]) == names, section


# A bad value for each kind of setting (and for an int: below its minimum).
def _bad_values(setting) -> list:
    kind = setting.type
    if kind == "int":
        minimum = setting.minimum
        return ["3", True, 1.5] + ([minimum - 1] if minimum is not None else [])
    return {
        "number": [0, -1.5, float("inf"), "3", True],
        "bool": ["yes", 1, None],
        "str": [3, None],
        "path": [3],
        "choice": ["bogus", 1],
        "devices": [0, "all", 2.0],
        "layout": [3, 2.5],
        "loggers": [["neptune"], "neptune", 3, None],
        "int_list": [[3, 2], [0, 2], ["1"], 3],
        "steps": [[3, 2], [0, 2], ["1"], 3],
        "callbacks": [[object()], "callback"],
        "callable": [3],
        "tp_plan": [3],
        "resume": [3, "/no/such/checkpoint"],
        "metrics": [["accuracy"], "perplexity", 3, ["loss"]],
    }[kind]


CASES = [(name, bad) for name, s in SETTINGS.items() for bad in _bad_values(s)
         if not (bad is None and s.none)]


def _case_id(name, bad) -> str:
    """Stable across processes (an object's repr holds its address)."""
    text = repr(bad)
    return f"{name}={re.sub(r' at 0x[0-9a-f]+', '', text)}"


@pytest.mark.parametrize("name,bad", CASES, ids=[_case_id(n, b) for n, b in CASES])
def test_each_setting_rejects_a_bad_value_naming_it(name, bad):
    with pytest.raises(ConfigError) as error:
        settings.check({name: bad})
    assert name in str(error.value), str(error.value)


def test_check_returns_every_value_and_knows_none():
    values = settings.check({"max_steps": 5, "stall_timeout_s": None, "layout": {"dp": 2}})
    assert values == {**settings.defaults(), "max_steps": 5, "stall_timeout_s": None,
                      "layout": {"dp": 2}, "name": "run"}  # name "auto": no script in pytest
    settings.check({"meta_init": True, "loggers": "csv", "split_points": [2, 5],
                    "devices": "auto", "resume": None, "nan_policy": None})
    with pytest.raises(ConfigError, match="max_steps must be a positive integer or None, got 0"):
        settings.check({"max_steps": 0})
    with pytest.raises(ConfigError, match="global_batch_size must be a positive integer, got None"):
        settings.check({"global_batch_size": None})
    with pytest.raises(ConfigError, match="unknown Trainer setting 'max_stepz'; did you mean "
                                          "'max_steps'"):
        settings.check({"max_stepz": 3})


def test_the_existing_wording_is_kept():
    for values, message in [
        ({"precision": "fp8"}, "unknown precision 'fp8'.*fp32, bf16-mixed, fp16-mixed"),
        ({"comm_hook": "int8"}, "unknown comm_hook 'int8'.*fp16, bf16, powersgd"),
        ({"loggers": ["neptune"]}, "unknown logger 'neptune'"),
        ({"nan_policy": "ignore"}, "nan_policy must be one of"),
        ({"stall_timeout_s": -1}, "stall_timeout_s must be a positive number"),
        ({"checkpoint_every_n_minutes": -2.0}, "checkpoint_every_n_minutes must be a number > 0"),
        ({"async_checkpoint": "yes"}, "async_checkpoint must be True or False"),
        ({"max_epochs": 0}, "max_epochs must be a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            settings.check(values)


def test_choices_agree_with_the_code_that_implements_them():
    from meshtrain.fault.nonfinite import NAN_POLICIES
    from meshtrain.parallel.compile import MODES as COMPILE_MODES
    from meshtrain.parallel.data.data_parallel import COMM_HOOKS
    from meshtrain.parallel.data.fully_shard import OFFLOADS
    from meshtrain.parallel.pipeline.partition import BALANCES
    from meshtrain.parallel.pipeline import SCHEDULES
    from meshtrain.parallel.shm.p2p import MODES as P2P_MODES
    from meshtrain.parallel.float8 import RECIPES as FLOAT8_RECIPES
    from meshtrain.precision import PRECISIONS

    assert SETTINGS["nan_policy"].choices == tuple(NAN_POLICIES)
    assert SETTINGS["comm_hook"].choices == tuple(COMM_HOOKS)
    assert (None, *SETTINGS["offload"].choices) == tuple(OFFLOADS)
    assert set(SETTINGS["pp_balance"].choices) == set(BALANCES)
    assert SETTINGS["pp_schedule"].choices == tuple(SCHEDULES)
    assert SETTINGS["local_comm"].choices == P2P_MODES
    assert SETTINGS["precision"].choices == tuple(PRECISIONS)
    assert SETTINGS["float8"].choices == FLOAT8_RECIPES
    assert SETTINGS["compile"].choices == (False, True, *COMPILE_MODES)


def test_flatten_converts_toml_stand_ins_and_names_the_right_section():
    config = {"job": {"recipe": "x"}, "trainer": {"max_steps": 3, "layout": "dp=2"},
              "checkpoint": {"resume": "none", "keep_last_k": 2},
              "fault": {"nan_policy": "None", "stall_timeout_s": "none"},
              "logging": {"name": "none", "loggers": ["csv"]}}
    assert settings.flatten(config) == {
        "max_steps": 3, "layout": "dp=2", "resume": None, "keep_last_k": 2, "nan_policy": None,
        "stall_timeout_s": None, "name": "none", "loggers": ["csv"]}
    with pytest.raises(ConfigError, match=r"resume is a \[checkpoint\] setting, not \[trainer\]"):
        settings.flatten({"trainer": {"resume": "none"}})
    with pytest.raises(ConfigError, match="callbacks is a Python-only Trainer setting"):
        settings.flatten({"trainer": {"callbacks": []}})
    with pytest.raises(ConfigError, match=r"unknown key pipeline.pp_schedul .*did you mean "
                                          r"pipeline.pp_schedule\?"):
        settings.flatten({"pipeline": {"pp_schedul": "gpipe"}})


def test_resolve_names_the_section_of_a_misplaced_key_and_the_closest_one():
    defaults = {"job": {"recipe": "r"}, **settings.config_sections()}
    with pytest.raises(ConfigError, match=r"trainer.nan_policy in override '--trainer.nan_policy"
                                          r"=skip': nan_policy is a \[fault\] setting, not "
                                          r"\[trainer\]; write it under \[fault\] \(or "
                                          r"--fault.nan_policy=...\)"):
        resolve(defaults, {}, ["--trainer.nan_policy=skip"])
    with pytest.raises(ConfigError, match=r"keep_last_k is a \[checkpoint\] setting"):
        resolve(defaults, {"trainer": {"keep_last_k": 2}}, [])
    with pytest.raises(ConfigError, match=r"unknown key parallel.ofload .*did you mean "
                                          r"parallel.offload\?"):
        resolve(defaults, {}, ["--parallel.ofload=cpu"])
    with pytest.raises(ConfigError, match=r"unknown key trainer.pp_schedul .*did you mean "
                                          r"pipeline.pp_schedule\?"):
        resolve(defaults, {}, ["--trainer.pp_schedul=gpipe"])
    with pytest.raises(ConfigError, match=r"unknown section \[pipelin\].*did you mean "
                                          r"\[pipeline\]"):
        resolve(defaults, {"pipelin": {"pp_schedule": "gpipe"}}, [])
    with pytest.raises(ConfigError, match="tp_plan is a Python-only Trainer setting"):
        resolve(defaults, {}, ["--parallel.tp_plan={}"], settings.python_only())


def test_dumps_toml_shows_none_as_a_comment_and_reads_back():
    config = {"job": {"recipe": "r"}, **settings.config_sections()}
    config["trainer"]["layout"] = {"dp_shard": 2, "tp": 2}
    config["pipeline"]["split_points"] = [2, 4]
    text = dumps_toml(config)
    assert "# max_epochs = none" in text and "# comm_hook = none" in text
    assert "layout = {dp_shard = 2, tp = 2}" in text
    assert 'loggers = ["csv", "tensorboard"]' in text
    back = tomllib.loads(text)
    assert back == {section: {k: v for k, v in values.items() if v is not None}
                    for section, values in config.items()}


def test_docs_reference_is_generated_from_the_definitions():
    from meshtrain._public import reference_document

    text = reference_document()
    on_disk = (ROOT / "docs" / "reference.md").read_text()
    assert on_disk == text, "docs/reference.md is stale: run python tools/gen_reference.py"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end != -1 else None]


def test_the_reference_lists_every_trainer_and_callback_argument():
    text = settings.reference_markdown()
    for name in {*_trainer_parameters(), *SETTINGS}:
        section = _section(text, f"## [{SETTINGS[name].section}]")
        assert f"| `{name}` |" in section, f"Trainer({name}=) is missing from the reference"
    callbacks = {name: obj for name, obj in vars(meshtrain).items() if name in meshtrain.__all__
                 and isinstance(obj, type) and issubclass(obj, meshtrain.Callback)
                 and obj is not meshtrain.Callback}
    assert {"EarlyStopping", "ModelCheckpoint", "LearningRateMonitor"} <= set(callbacks)
    for name, cls in callbacks.items():
        params = set(inspect.signature(cls).parameters)
        assert set(reference.CALLBACK_ARGS.get(name, {})) == params, (
            f"{name}'s arguments and CALLBACK_ARGS in meshtrain/settings/reference.py disagree")
        section = _section(text, f"### {name}")
        for param in params:
            assert f"| `{param}` |" in section, f"{name}({param}=) is missing from the reference"
    assert "UNDOCUMENTED" not in text
    for word in ("save_top_k", "min_delta", "pp_schedule", "activation_checkpointing"):
        assert f"`{word}`" in text


def test_the_args_docstring_has_every_setting():
    doc = settings.docstring()
    assert doc.startswith("Args:\n")
    for name, setting in SETTINGS.items():
        assert f"\n    {name}: " in doc, name
    assert "Python only" in doc and "config [pipeline]" in doc


# -- what each setting needs (Setting.needs) ---------------------------------------------------
# A valid value other than the default for each setting that has needs or is named by one.
NEEDS_SAMPLES = {
    "bucket_cap_mb": 10, "comm_hook": "fp16", "powersgd_rank": 2, "offload": "cpu",
    "shard_unit_mb": 16,
    "blocks": lambda model: [], "meta_init": False, "sequence_parallel": True,
    "loss_parallel": True, "local_sgd_every": 4, "outer_lr": 0.7, "outer_momentum": 0.5,
    "ps_mode": "async", "ps_staleness": 1, "tp_plan": {}, "pp_schedule": "gpipe",
    "stages_per_rank": 2, "pp_balance": "time", "split_points": [2],
    "activation_checkpointing": "full", "compile": True, "tp_check_steps": 0,
    "plan_cluster": "8xH100", "straggler_margin": 0.5, "local_comm": "backend",
    "sync_batchnorm": False, "keep_last_k": 2, "async_checkpoint": True,
    "checkpoint_every_n_steps": 10, "collective_timeout_s": 500.0, "init_timeout_s": 100.0,
    "stall_timeout_s": None, "debug_collectives": True, "mtbf_hours": 5.0,
    "float8_emulate": True, "float8": "tensorwise", "sdc_check_every_n_steps": 2,
}
# layouts that have a layout fact, and ones that lack it (an axis: "axis=2", and left out)
WITH_FACT = {"ddp": "dp=2", "plain_dp": "dp=2", "sharded": "zero3=2", "ps": "ps=1,dp=2",
             "batch": "dp=2", "ranks": "dp=2", "processes": "dp=2", "replayable": "dp=2"}
WITHOUT_FACT = {"ddp": "zero3=2", "plain_dp": "zero1=2", "sharded": "dp=2", "ps": "dp=2",
                "batch": "tp=2", "ranks": "dp=1", "processes": "dp=1", "replayable": "zero3=2"}


def _meet(need: str, parts: list, values: dict) -> None:
    """Add to ``parts`` (of a layout) and ``values`` what meets ``need`` (its first choice)."""
    from meshtrain.settings.kinds import need_atom

    kind, name, value = need_atom(need.split("|")[0])
    if kind == "axis":
        parts.append(f"{name}=2")
    elif kind == "fact":
        parts.append(WITH_FACT[name])
    elif kind in ("set", "equals"):
        values[name] = NEEDS_SAMPLES[name] if kind == "set" else value
        for inner in SETTINGS[name].needs:
            _meet(inner, parts, values)


def _break(need: str, parts: list, values: dict) -> None:
    """Change ``parts`` and ``values`` so that no choice of ``need`` is met."""
    from meshtrain.settings.kinds import need_atom

    for atom in need.split("|"):
        kind, name, value = need_atom(atom)
        if kind == "axis":
            parts[:] = [p for p in parts if p != f"{name}=2"]
        elif kind == "fact":
            parts[:] = [WITHOUT_FACT[name] if p == WITH_FACT[name] else p for p in parts]
        elif kind == "differs":  # the value it must not have ("None")
            values[name] = ast.literal_eval(value)
        elif kind == "unset":
            values[name] = NEEDS_SAMPLES[name]
            for inner in SETTINGS[name].needs:
                _meet(inner, parts, values)
        else:
            values.pop(name, None)


def _layout(parts: list):
    """The Layout of ``parts`` ("dp=2", "pp=2", ...) joined; one process when none."""
    from meshtrain.parallel.layout import Layout
    from meshtrain.parity import layout_world_size

    spec = ",".join(dict.fromkeys(parts)) or "dp=1"
    return Layout.parse(spec, layout_world_size(spec))


def _apply(parts: list, values: dict) -> None:
    """check_settings_apply (what the Trainer runs before any process) on a layout + values."""
    from meshtrain.checks import check_settings_apply

    check_settings_apply(_layout(parts), settings.check({"max_steps": 1, **values}))


NEEDING = [(name, i) for name, s in SETTINGS.items() for i in range(len(s.needs))]


@pytest.mark.parametrize("name,index", NEEDING, ids=[f"{n}-{i}" for n, i in NEEDING])
def test_a_setting_whose_need_is_unmet_is_refused_by_name(name, index):
    """Walks the table: each need of each setting, met (no error) and unmet (an error naming
    the setting); the check is derived from the table, so a new setting cannot forget it."""
    sample = NEEDS_SAMPLES[name]
    SETTINGS[name].validate(sample)
    assert not at_default(SETTINGS[name], sample), name
    parts, values = [], {name: sample}
    for need in SETTINGS[name].needs:
        _meet(need, parts, values)
    _apply(list(parts), dict(values))  # every need met: no error
    _break(SETTINGS[name].needs[index], parts, values)
    with pytest.raises(ConfigError) as error:
        _apply(parts, values)
    assert f"{name}=" in str(error.value) or f"{name} " in str(error.value), str(error.value)
    del values[name]  # at its default, the setting itself is never an error
    assert name not in [n for n, _, _ in settings.unmet_needs(
        _layout(parts), settings.check({"max_steps": 1, **values}))]


@pytest.mark.parametrize("spec", ["dp=1", "dp=2", "zero1=2", "zero3=2", "tp=2", "pp=2",
                                  "cp=2", "ps=1,dp=2", "pp=2,dp_shard=2,tp=2"])
def test_defaults_are_never_an_error_under_any_layout(spec):
    assert settings.unmet_needs(_layout([spec]), settings.check({"max_steps": 1})) == []


def test_the_reference_and_the_docstring_show_each_setting_s_needs():
    text, doc = settings.reference_markdown(), settings.docstring()
    row = next(line for line in text.splitlines() if line.startswith("| `pp_schedule` |"))
    assert "| a pp axis in the layout |" in row
    row = next(line for line in text.splitlines() if line.startswith("| `powersgd_rank` |"))
    assert "comm_hook='powersgd'" in row
    assert "needs a layout that uses DDP" in " ".join(doc.split())  # comm_hook's
    for name, s in SETTINGS.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert (reference.needs_text(s) in row) and bool(s.needs) == bool(reference.needs_text(s))


def test_inapplicable_leaves_out_layout_settings_and_what_needs_them_only():
    values = settings.check({"max_steps": 1, "tp_plan": {}, "comm_hook": "powersgd",
                             "powersgd_rank": 4, "pp_schedule": "gpipe"})
    assert settings.inapplicable(_layout(["dp=1"]), values) == [
        "comm_hook", "tp_plan", "pp_schedule", "powersgd_rank"]
    assert settings.inapplicable(_layout(["dp=2"]), values) == ["tp_plan", "pp_schedule"]
    assert settings.inapplicable(_layout(["pp=2", "tp=2"]), values) == [
        "comm_hook", "powersgd_rank"]
    # a user's own mistake (powersgd_rank without comm_hook) is not dropped: it is refused
    alone = settings.check({"max_steps": 1, "powersgd_rank": 4})
    assert settings.inapplicable(_layout(["dp=2"]), alone) == []
