"""The import surface users write against: every `meshtrain` import the docs show works, the
public modules' `__all__` are what docs/reference.md lists, and the old paths of moved modules
still import (the same module, one DeprecationWarning naming the new path), down to a user's
own tp plan written against the earlier docs training under tp=2 like one process.

The checks that need a fresh interpreter (what the docs show, the old paths' first imports, the
lazy packages) run in one subprocess, ``PROBE``, whose report the tests share."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_script, script_env
from parity_models import TP_USER_BLOCK

from meshtrain._graveyard import MOVED
from meshtrain._public import API_HEADING, PUBLIC_MODULES

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]

# `from meshtrain.x import a, b` (parenthesised over lines too) and `import meshtrain.x.y`,
# in code blocks, inline code and example scripts
IMPORT = re.compile(r"(?<![\w.])(?:from\s+(meshtrain[\w.]*)\s+import\s+(\([^)]*\)|[^\n#`;]+)"
                    r"|import\s+(meshtrain[\w.]*))")
# a dotted name in inline code: `meshtrain.losses.cross_entropy(...)`, `meshtrain.EMA`
REFERENCE = re.compile(r"`(meshtrain(?:\.\w+)+)[`(]")
FILE_SUFFIXES = ("json", "toml", "py", "md", "yaml", "csv", "txt")

# Memory's names that its old module held, now in meshtrain.observe.memory.probe
MEMORY_NAMES = ["MemoryProbe", "memory_summary"]

PROBE = r"""
import importlib, json, sys, warnings

import meshtrain, meshtrain.models, meshtrain.parallel.context, meshtrain.parallel.tensor
report = {"torch_with_lazy_packages": "torch" in sys.modules}

def ours(caught):
    return [{"message": str(w.message), "file": w.filename} for w in caught
            if issubclass(w.category, DeprecationWarning)
            and str(w.message).startswith("meshtrain.")]

def resolve(dotted):
    obj = meshtrain
    for part in dotted.split(".")[1:]:
        if not hasattr(obj, part):
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        else:
            obj = getattr(obj, part)
    return obj

job = json.loads(sys.stdin.read())
report["docs"] = []  # each import and reference the docs show, in this fresh interpreter
for where, kind, text in job["docs"]:
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(text, {}) if kind == "import" else resolve(text)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    old = ours(caught)
    if error is None and old:
        error = "an old path: " + old[0]["message"]
    report["docs"].append([where, text, error])

report["moved"] = {}  # each old path, imported twice
for old, (new, _) in job["moved"].items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = importlib.import_module(old)
        first_warnings = ours(caught)
        again = importlib.import_module(old)
    parent, _, leaf = old.rpartition(".")
    report["moved"][old] = {
        "warnings": first_warnings, "again": ours(caught)[len(first_warnings):],
        "same": first is sys.modules[new] and again is first and sys.modules[old] is first,
        "attribute": getattr(sys.modules[parent], leaf) is first,
        "spec": first.__spec__.name}

report["names"] = {}  # names that left meshtrain.observe.memory's old module
for name in job["names"]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from meshtrain.observe.memory import {name} as first", scope := {})
        exec(f"from meshtrain.observe.memory import {name} as again", scope)
    probe = importlib.import_module("meshtrain.observe.memory.probe")
    report["names"][name] = {"warnings": ours(caught),
                             "same": scope["first"] is scope["again"] is getattr(probe, name)}
print(json.dumps(report))
"""


def doc_imports_and_references() -> list[tuple[str, str, str]]:
    """(file:line, "import" or "reference", the statement or dotted name) for every meshtrain
    import statement and dotted name in inline code that the docs and examples show."""
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        if path.name == "reference.md":  # its last section lists the old paths on purpose
            text = text[:text.index("## Moved modules")]
        for match in IMPORT.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            if match.group(3):
                found.append((where, "import", f"import {match.group(3)}"))
            else:
                names = " ".join(match.group(2).strip().strip("()").split()).rstrip(",")
                found.append((where, "import", f"from {match.group(1)} import {names}"))
        if path.suffix == ".md":
            for match in REFERENCE.finditer(text):
                if match.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES:
                    where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
                    found.append((where, "reference", match.group(1)))
    return found


@pytest.fixture(scope="module")
def probe():
    job = {"docs": doc_imports_and_references(), "names": MEMORY_NAMES,
           "moved": {old: list(new) for old, new in MOVED.items()}}
    done = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps(job), cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(180)
def test_every_meshtrain_import_the_docs_show_works_and_is_no_old_path(probe):
    broken = [f"{where}: {text} -> {error}" for where, text, error in probe["docs"] if error]
    assert not broken, "\n".join(broken)
    # what the docs are known to show (the extraction found them)
    statements = {text for _, text, _ in probe["docs"]}
    assert {"from meshtrain import Trainer, EarlyStopping, ModelCheckpoint",
            "from meshtrain.parallel.tensor import attention_plan, mlp_plan",
            "from meshtrain.sweep import run_sweep", "meshtrain.losses.cross_entropy",
            "meshtrain.models.HFCausalLM"} <= statements, statements
    # the public packages are lazy: `import meshtrain` and they import no torch
    assert probe["torch_with_lazy_packages"] is False


def _reference_api() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "reference.md").read_text()
    section = text[text.index(API_HEADING):text.index("## Moved modules")]
    listed: dict[str, list[str]] = {}
    for line in section.splitlines():
        if heading := re.fullmatch(r"### `([\w.]+)`", line):
            listed[heading.group(1)] = []
        elif row := re.match(r"\| `(\w+)` \|", line):
            listed[list(listed)[-1]].append(row.group(1))
    return listed


def test_the_reference_lists_each_public_modules_all_and_each_name_resolves():
    listed = _reference_api()
    assert list(listed) == list(PUBLIC_MODULES)
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        assert listed[name] == list(module.__all__), name
        for export in module.__all__:
            assert getattr(module, export) is not None, f"{name}.{export}"
    # what a tp_plan, a model's own cp and the MoE GPT are written with
    tensor = set(listed["meshtrain.parallel.tensor"])
    assert {"attention_plan", "mlp_plan", "ReplicateParallel"} <= tensor
    assert "cp_attention" in listed["meshtrain.parallel.context"]
    assert {"GPT", "GPTConfig"} <= set(listed["meshtrain.models"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_one_warning_naming_it(probe, old):
    new, public = MOVED[old]
    seen = probe["moved"][old]
    assert seen["same"] and seen["attribute"], seen  # the same module object, also as attribute
    assert seen["spec"] == new  # its own spec kept
    assert len(seen["warnings"]) == 1 and seen["again"] == [], seen
    message = seen["warnings"][0]["message"]
    assert f"{old} is now {new}" in message
    assert public is None or f"import its public names from {public}" in message
    assert seen["warnings"][0]["file"] == "<string>"  # the importing line, not the machinery


@pytest.mark.timeout(180)
def test_names_that_left_observe_memory_are_read_there_with_a_warning(probe):
    for name in MEMORY_NAMES:
        seen = probe["names"][name]
        assert seen["same"], name
        assert [w["message"] for w in seen["warnings"]] == [
            f"meshtrain.observe.memory.{name} is now meshtrain.observe.memory.probe.{name}; "
            "the old path will be removed"]


# A user's model and its tp plan (heads reshaped with local sizes), trained by a script under
# tp=2 and in this process as one process
USER_MODEL = TP_USER_BLOCK + """

def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


SETTINGS = dict(max_steps=4, global_batch_size=16, seed=0, loggers=(), progress_bar=False,
                report=False, save_final_checkpoint=False)
"""

USER_SCRIPT = """
import os, sys
from pathlib import Path

out = Path(sys.argv[1])
(out / f"{os.getpid()}.pid").write_text(str(os.getpid()))

from meshtrain.parallel.tensor_parallel import attention_plan, mlp_plan
from meshtrain import Trainer
""" + USER_MODEL + """
PLAN = {**attention_plan("attn", "q", "k", "v", "out"), **mlp_plan("", "fc_in", "fc_out")}

trainer = Trainer(layout="tp=2", devices=2, tp_plan=PLAN, run_dir=str(out / "run"), **SETTINGS)
model = trainer.fit(Block, data(), optimizer=sgd, loss_fn=torch.nn.functional.mse_loss)
q = model.attn.q.weight
whole = trainer.whole_model().state_dict()
if trainer.is_global_zero:
    torch.save({"whole": whole, "q_local": list(q.to_local().shape)}, out / "tp.pt")
"""


@pytest.mark.timeout(300)
def test_a_users_tp_plan_from_the_earlier_docs_trains_under_tp2_like_one_process(tmp_path):
    """`from meshtrain.parallel.tensor_parallel import attention_plan, mlp_plan`, as the docs
    showed before parallel/ was grouped (a ModuleNotFoundError then), in a script run with
    plain python: it warns on each rank's import line and trains under tp=2 with the plan
    split as written, to the weights one process trains."""
    script = tmp_path / "train_tp.py"
    script.write_text(USER_SCRIPT)
    done = run_script(script, tmp_path, cwd=tmp_path, pid_dir=tmp_path, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = USER_SCRIPT.splitlines().index(
        "from meshtrain.parallel.tensor_parallel import attention_plan, mlp_plan") + 1
    warning = (f"{script}:{line}: DeprecationWarning: meshtrain.parallel.tensor_parallel is now "
               "meshtrain.parallel.tensor.tensor_parallel (import its public names from "
               "meshtrain.parallel.tensor)")
    assert done.stderr.count(warning) == 2, done.stderr[-3000:]  # each rank's script says it
    assert len(list(tmp_path.glob("*.pid"))) == 2
    result = torch.load(tmp_path / "tp.pt")
    assert result["q_local"] == [8, 16]  # q split by output rows over the 2 ranks

    from meshtrain import Trainer

    scope: dict = {}
    exec(USER_MODEL, scope)
    start: dict = {}

    def build():
        model = scope["Block"]()
        start.update({k: v.clone() for k, v in model.state_dict().items()})
        return model

    torch.set_num_threads(1)
    trainer = Trainer(run_dir=str(tmp_path / "one"), **scope["SETTINGS"])
    one = trainer.fit(build, scope["data"](), optimizer=scope["sgd"],
                      loss_fn=torch.nn.functional.mse_loss).state_dict()
    assert sorted(one) == sorted(result["whole"])
    for name, value in one.items():
        assert torch.allclose(result["whole"][name], value, atol=1e-6), name
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    assert moved > 1e-3, moved  # (so the agreement says something)
