"""meshtrain sweep: trials side by side on disjoint cores, each an ordinary `meshtrain train` run
whose ranks read the same hyperparameters; the best config trains to the best objective; a
killed sweep continues where it stopped; a bad trial is pruned at its first validation; bad
inputs are refused before any trial starts. The job is the demo's recipe at a tiny size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from meshtrain.errors import ConfigError  # noqa: E402
from meshtrain.sweep import run_sweep  # noqa: E402

JOB = """
[job]
recipe = "char_lm"
[data]
max_chars = 20000
seq_len = 32
val_fraction = 0.1
[model]
num_layers = 1
num_heads = 2
d_model = 32
[optimizer]
lr = 3e-3
warmup_steps = 2
[trainer]
layout = "none"
devices = 1
max_steps = 12
global_batch_size = 8
val_every_n_steps = 4
limit_val_batches = 4
[checkpoint]
checkpoint_every_n_steps = 4
[logging]
name = "tiny"
log_every_n_steps = 4
report = false
[sample]
num_chars = 10
"""


def job(tmp_path: Path, **sections) -> str:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return str(path)


def space(**sweep) -> dict:
    return {"objective": {"metric": "val/loss", "direction": "minimize"},
            "sweep": {"pruner": "none", **sweep},
            "params": {"optimizer.lr": {"low": 1e-3, "high": 3e-2, "log": True},
                       "trainer.devices": {"choices": [1, 2]}}}


def meshtrain(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120)


def overlap(a, b) -> bool:
    return (a.user_attrs["started_at"] < b.user_attrs["ended_at"]
            and b.user_attrs["started_at"] < a.user_attrs["ended_at"])


@pytest.mark.timeout(240)
def test_trials_run_side_by_side_and_the_best_config_trains_to_the_best_objective(tmp_path):
    table = space(trials=4, concurrent=2, devices_per_trial=1)
    table["enqueue"] = [{"trainer.devices": 2}]  # trial 0 is dp over 2 processes
    study = run_sweep(job(tmp_path), table=table, sweep_dir=tmp_path / "sweep", log=lambda m: 0)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert overlap(trials[0], trials[1])  # 2 at a time, on cores of their own
    result = json.loads((tmp_path / "sweep" / "trial_0000" / "sweep_result.json").read_text())
    assert result["ranks_params"] == [trials[0].params] * 2  # both ranks of the dp trial
    assert trials[0].params["trainer.devices"] == 2
    assert {p.name for p in (tmp_path / "sweep" / "plots").iterdir()} >= {"history.png"}
    report = (tmp_path / "sweep" / "report.html").read_text()
    assert f"{study.best_value:.6g}" in report and "data:image/png;base64," in report
    # the best config, run by hand, reaches the best trial's objective (same seed)
    best = tmp_path / "sweep" / "best.toml"
    run = meshtrain("train", str(best), f"--logging.run_dir={json.dumps(str(tmp_path / 'b'))}",
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    final = json.loads((tmp_path / "b" / "checkpoints" / "final" / "meshtrain.json").read_text())
    assert final["metrics"]["val/loss"] == pytest.approx(study.best_value, abs=1e-6)


@pytest.mark.timeout(180)
def test_a_trial_with_a_bad_learning_rate_is_pruned_at_its_first_validation(tmp_path):
    table = space(trials=2, concurrent=1, pruner="median", pruner_startup_trials=1)
    table["params"] = {"optimizer.lr": {"low": 1e-3, "high": 100.0, "log": True}}
    table["enqueue"] = [{"optimizer.lr": 3e-3}, {"optimizer.lr": 100.0}]
    study = run_sweep(job(tmp_path), table=table, sweep_dir=tmp_path / "sweep", log=lambda m: 0,
                      overrides=["--trainer.max_steps=8"])
    good, bad = study.get_trials()
    assert good.state.name == "COMPLETE" and bad.state.name == "PRUNED"
    assert list(bad.intermediate_values) == [4]  # its first validation, at step 4
    assert bad.user_attrs["steps"] == 4
    events = (tmp_path / "sweep" / "trial_0001" / "run" / "events.jsonl").read_text()
    assert '"pruned"' in events  # the run folder says why it stopped


@pytest.mark.timeout(240)
def test_a_killed_sweep_continues_its_running_trials_from_their_checkpoints(tmp_path):
    config = job(tmp_path)
    folder = tmp_path / "sweep"
    space_file = tmp_path / "space.toml"
    space_file.write_text('[objective]\nmetric = "val/loss"\n[sweep]\ntrials = 2\nconcurrent = 2\n'
                          'pruner = "none"\n[params]\n"optimizer.lr" = { low = 1e-3, '
                          'high = 3e-2, log = true }\n')
    command = [sys.executable, "-m", "meshtrain", "sweep", config, "--space", str(space_file),
               "--dir", str(folder), "--trainer.max_steps=40"]
    sweep = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    firsts = [folder / f"trial_000{i}" / "run" / "checkpoints" / "step_00000004" for i in (0, 1)]
    while not all(p.exists() for p in firsts):  # both trials are past their first checkpoint
        assert sweep.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    time.sleep(1)  # the trials die with the sweep
    # a trial that already wrote its final checkpoint (a much faster peer on a busy machine)
    # has ended and is not run again; the others are
    ended = [(folder / f"trial_000{i}" / "run" / "checkpoints" / "final").exists() for i in (0, 1)]
    assert not all(ended), "both trials ended before the kill: nothing to continue"
    said = []  # the same sweep again (here, in this process)
    study = run_sweep(config, str(space_file), sweep_dir=folder, log=said.append,
                      overrides=["--trainer.max_steps=40"])
    assert any("continuing 2 trial(s)" in line for line in said)
    trials = optuna.load_study(study_name="tiny",
                               storage=f"sqlite:///{folder / 'study.db'}").get_trials()
    assert [t.number for t in study.get_trials()] == [0, 1]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    # run again if it had not ended, none a third time
    assert [t.user_attrs["starts"] for t in trials] == [1 if e else 2 for e in ended]
    for number in (n for n in (0, 1) if not ended[n]):  # resumed from a checkpoint, not afresh
        log = (folder / f"trial_000{number}" / "log.txt").read_text()
        assert "resumed from" in log and "at step 0" not in log.split("resumed from")[1][:200]


def test_bad_inputs_are_refused_before_any_trial(tmp_path):
    config = job(tmp_path)
    cases = [
        ({"params": {"optimizer.learning_rate": {"low": 1e-3, "high": 1e-2}}},
         "unknown key optimizer.learning_rate .* known keys of \\[optimizer\\]: lr"),
        ({"params": {"optimizer.lr": {"low": 1e-2, "high": 1e-3}}}, "low 0.01 > high 0.001"),
        ({"params": {"trainer.layout": {"choices": ["dp=banana"]}}}, "trainer.layout"),
        ({"sweep": {"devices_per_trial": os.cpu_count() + 1}}, "devices_per_trial="),
        ({"sweep": {"storage": "postgresql://nobody@127.0.0.1:1/none"}},
         "cannot open the sweep's storage"),
    ]
    for change, match in cases:
        table = space()
        for section, values in change.items():
            table[section] = values if section == "params" else {**table[section], **values}
        with pytest.raises(ConfigError, match=match):
            run_sweep(config, table=table, sweep_dir=tmp_path / "never", log=lambda m: 0)
    assert not (tmp_path / "never").exists()
