"""No quiet skips in CI: a pytest plugin (tests/conftest.py loads it).

A test whose real program, server or package is missing skips with the reason (headless
Chromium, Slurm's daemons, lightning, optuna, ...): on a developer's machine that is a fair
answer. The CI (``CI=true bash .ci/run``) installs all of them, so there such a skip is a
failure that names what is missing: a skipped test there would report a green run that never
ran it. The only skips left in CI are the tests marked ``gpu`` (CI has no GPU). The hooks turn
the skip of a test (in its setup, its call, a ``skipif``) and of a whole module (a module-level
``pytest.importorskip``) into a failure; expected failures (``xfail``) are left alone.
"""

from __future__ import annotations

import os

import pytest

ALLOWED = ("gpu",)  # markers whose tests may skip in CI


def in_ci() -> bool:
    """``CI`` set to anything but empty, 0, false or no (CI services set CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail(report) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"CI={os.environ.get('CI')}: skipped ({_reason(report.longrepr)}), and in CI a test "
        "does not skip for want of a program, server or package: install it in .ci/run (system "
        "packages) or in pyproject's [test] extra (Python packages). Only tests marked "
        f"{', '.join(ALLOWED)} skip in CI.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and in_ci()
            and not any(item.get_closest_marker(name) for name in ALLOWED)):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci():  # a module skipped whole (pytest.importorskip)
        _fail(report)
