"""No quiet skips in CI (tests/ci_skips.py): a tiny test file, run by pytest in a process of its
own with the plugin, skips what it lacks without ``CI`` and fails with ``CI=true``, naming it;
a ``gpu`` test still skips."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(120)

TINY = '''
import shutil

import pytest

NAME = "meshtrain-no-such-program"


@pytest.mark.skipif(shutil.which(NAME) is None, reason=f"{NAME} is not installed")
def test_needs_a_program():
    pass


@pytest.fixture
def server():
    pytest.skip("no database server answers on 127.0.0.1:1")


def test_needs_a_server(server):
    pass


def test_finds_no_daemon():
    pytest.skip("no slurmctld on this machine")


@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_on_a_gpu():
    pass


@pytest.mark.xfail(reason="a known bug", strict=True)
def test_a_known_bug():
    assert False


def test_that_runs():
    pass
'''
NEEDS_A_MODULE = '''
import pytest

pytest.importorskip("meshtrain_no_such_module", reason="pip install meshtrain_no_such_module")


def test_uses_it():
    pass
'''


def run_tiny(tmp_path, ci: str | None, *files: str) -> tuple[int, str]:
    """pytest -ra (as `make test`) on the tiny ``files`` with the plugin (and CI=``ci``): its
    exit code and output."""
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "test_needs_a_module.py").write_text(NEEDS_A_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("PYTEST_")}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT / "tests")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider", "-q", "-ra",
         "-W", "ignore::pytest.PytestUnknownMarkWarning", *files],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_without_ci_a_missing_program_skips_with_its_reason(tmp_path, ci):
    code, out = run_tiny(tmp_path, ci, "test_tiny.py", "test_needs_a_module.py")
    assert code == 0, out
    assert re.search(r"1 passed, 5 skipped, 1 xfailed", out), out
    for reason in ("meshtrain-no-such-program is not installed",
                   "no database server answers on 127.0.0.1:1", "no slurmctld on this machine",
                   "needs a CUDA device", "pip install meshtrain_no_such_module"):
        assert re.search(rf"SKIPPED \[\d+\] .*{re.escape(reason)}", out), (reason, out)


def test_in_ci_a_missing_program_fails_naming_it_and_a_gpu_test_still_skips(tmp_path):
    code, out = run_tiny(tmp_path, "true", "test_tiny.py")
    assert code == 1, out
    assert re.search(r"1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors", out), out
    # skipped in their setup (the skipif mark, the fixture) or in the test
    assert "ERROR test_tiny.py::test_needs_a_program" in out
    assert "ERROR test_tiny.py::test_needs_a_server" in out
    assert "FAILED test_tiny.py::test_finds_no_daemon" in out
    for reason in ("meshtrain-no-such-program is not installed",
                   "no database server answers on 127.0.0.1:1", "no slurmctld on this machine"):
        assert f"CI=true: skipped ({reason}), and in CI a test does not skip" in out, reason
    assert re.search(r"SKIPPED \[1\] test_tiny.py:\d+: needs a CUDA device", out), out


def test_in_ci_a_missing_package_fails_the_collection_naming_it(tmp_path):
    code, out = run_tiny(tmp_path, "true", "test_needs_a_module.py")
    assert code == 2, out  # pytest's collection error: nothing runs
    assert "ERROR collecting test_needs_a_module.py" in out
    assert ("CI=true: skipped (pip install meshtrain_no_such_module), and in CI a test does "
            "not skip") in out
