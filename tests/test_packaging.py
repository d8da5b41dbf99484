"""Packaging: every package meshtrain imports is declared (core or an extra), the core ones
are what a plain import needs, and the wheel installs and runs outside the source tree."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"mlflow": "mlflow-skinny", "yaml": "pyyaml"}


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        import re

        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    extras = set().union(*(names(v) for k, v in project["optional-dependencies"].items()
                           if k != "test"))
    return names(project["dependencies"]), extras


def _imports() -> tuple[set[str], set[str]]:
    """(top-level names imported at module level, names imported anywhere) in meshtrain/."""
    top, anywhere = set(), set()
    for path in (ROOT / "meshtrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = {node.module.split(".")[0]}
            else:
                continue
            anywhere |= found
            if node in tree.body or any(node in getattr(n, "body", ()) for n in tree.body
                                        if isinstance(n, ast.Try)):
                top |= found
    third = lambda names: {n for n in names if n not in sys.stdlib_module_names  # noqa: E731
                           and n not in ("meshtrain", "__future__")}
    return third(top), third(anywhere)


def test_every_imported_package_is_declared():
    core, extras = _declared()
    top, anywhere = _imports()
    dist = {name: DISTRIBUTIONS.get(name, name).lower() for name in anywhere}
    missing = sorted(name for name, d in dist.items() if d not in core | extras)
    assert not missing, f"imported but declared nowhere in pyproject.toml: {missing}"
    at_import = sorted(name for name in top if dist[name] not in core)
    assert not at_import, f"imported when meshtrain is imported, but only an extra: {at_import}"
    assert "import tomllib" in (ROOT / "meshtrain" / "config.py").read_text()  # hence 3.11
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"


@pytest.mark.timeout(300)
def test_the_wheel_installs_and_trains_outside_the_source_tree(tmp_path):
    """Built without the source tree on the path, installed with --no-deps (its dependencies
    are this environment's), run from elsewhere: --help, and two steps of the README's job."""
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                           capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("meshtrain-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                                str(site), str(wheel)], capture_output=True, text=True,
                               timeout=120)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert list(site.glob("meshtrain/observe/report/*.j2"))  # the report's template came along
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.toml").write_text((ROOT / "examples" / "char_gpt.toml").read_text())
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=200)

    where = subprocess.run([sys.executable, "-c", "import meshtrain; print(meshtrain.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(site)), where
    assert "commands:" in run("--help").stdout
    out = run("train", "job.toml", "--trainer.max_steps", "2", "--trainer.devices", "1",
              "--trainer.layout", "none", "--checkpoint.resume", "none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fit: 2 steps" in out.stdout
