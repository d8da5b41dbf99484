"""meshtrain sweep: trials side by side on disjoint cores, each an ordinary `meshtrain train` run
whose ranks train with the same hyperparameters (a job whose rank 1 does not fails its trial and
stops the sweep); the best config trains to the best objective; a killed sweep continues where it
stopped; a bad trial is pruned at its first validation; bad inputs, an objective the job does not
log among them, are refused before any trial starts (also by --dry-run), or at the first trial's
first validation when the recipe does not say what it logs. The job is the demo's recipe at a
tiny size, or tests/sweep_job.py, a recipe of a user's own."""

from __future__ import annotations

import html
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from meshtrain import cli  # noqa: E402
from meshtrain.errors import ConfigError  # noqa: E402
from meshtrain.recipes import char_lm, resolve_config  # noqa: E402
from meshtrain.sweep import run_sweep  # noqa: E402

TESTS = Path(__file__).parent

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
    results = [json.loads((tmp_path / "sweep" / f"trial_000{t.number}" / "sweep_result.json")
                          .read_text()) for t in trials]
    # both ranks of the dp trial hold the study's learning rate (the scheduler's base)
    assert trials[0].params["trainer.devices"] == 2 and len(results[0]["ranks"]) == 2
    assert [r["optimizer"]["initial_lr"] for r in results[0]["ranks"]] == [
        [trials[0].params["optimizer.lr"]]] * 2
    # 2 at a time, each rank pinned within its trial's slot; trials that ran at once: disjoint
    assert overlap(trials[0], trials[1])
    cores = [{c for r in result["ranks"] for c in r["cpus"]} for result in results]
    for trial, used in zip(trials, cores):
        assert used <= set(trial.user_attrs["slot"]), (used, trial.user_attrs["slot"])
    for a in trials:
        for b in trials[a.number + 1:]:
            assert not overlap(a, b) or not cores[a.number] & cores[b.number], (a.number, b.number)
    # what the recipe says it logs (the sweep's check before any trial) is what a trial logged
    header = (tmp_path / "sweep" / "trial_0000" / "run" / "metrics.csv").open().readline()
    assert set(header.strip().split(",")[1:]) == set(
        char_lm.metrics(resolve_config(job(tmp_path), [])[1]))
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


OWN_JOB = """
[job]
recipe = "sweep_job"
[trainer]
layout = "none"
devices = 1
max_steps = 12
global_batch_size = 8
val_every_n_steps = 4
[logging]
name = "own"
log_every_n_steps = 4
report = false
"""


def own_job(tmp_path: Path, monkeypatch) -> str:
    """tests/sweep_job.py's job, its recipe importable here and in the trials."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))
    path = tmp_path / "own.toml"
    path.write_text(OWN_JOB)
    return str(path)


def sweep_cli(*args, capsys) -> tuple[int, str, str]:
    code = cli.main(["sweep", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_prints_the_plan_checks_the_objective_and_starts_nothing(tmp_path, capsys,
                                                                        monkeypatch):
    config, folder, space_file = job(tmp_path), tmp_path / "sweep", tmp_path / "space.toml"

    def space_with(metric: str, params: str = '"optimizer.lr" = { low = 1e-3, high = 3e-2, '
                   'log = true }') -> str:
        space_file.write_text(f'[objective]\nmetric = "{metric}"\n[sweep]\nconcurrent = 1\n'
                              f'[params]\n{params}\n')
        return str(space_file)

    code, out, err = sweep_cli(config, "--space", space_with("val/loss"), "--dry-run", "--dir",
                               str(folder), capsys=capsys)
    assert code == 0, err
    assert "machine split:\n  slot 0: core " in out
    assert "optimizer.lr: float in [0.001, 0.03], log scale" in out
    assert "objective: val/loss is logged by the job" in out
    assert out.rstrip().endswith("dry run: no trial was started")
    # the objective's typo, and what the sweep refused before: refused, nothing started
    code, out, err = sweep_cli(config, "--space", space_with("val_loss"), "--dry-run", "--dir",
                               str(folder), capsys=capsys)
    assert code == 2 and "Did you mean 'val/loss'?" in err
    assert "the objective metric 'val_loss' is not logged by the job job.toml" in err
    assert "train/loss" in err.split("which logs")[1]  # what it does log
    code, _, err = sweep_cli(config, "--space", space_with("val/loss", '"optimizer.learning_rate"'
                             ' = { low = 1e-3, high = 1e-2 }'), "--dry-run", "--dir",
                             str(folder), capsys=capsys)
    assert code == 2 and "unknown key optimizer.learning_rate" in err
    # a recipe that does not say what it logs: the metric is checked in the first trial
    code, out, err = sweep_cli(own_job(tmp_path, monkeypatch), "--space", space_with("val_loss"),
                               "--dry-run", "--dir", str(folder), capsys=capsys)
    assert code == 0, err
    assert "objective: val_loss is checked at the first trial's first validation" in out
    assert not folder.exists()


@pytest.mark.timeout(180)
def test_an_objective_the_job_does_not_log_fails_the_first_trial_and_stops_the_sweep(
        tmp_path, monkeypatch):
    table = {"objective": {"metric": "val_loss"}, "sweep": {"trials": 3, "concurrent": 1},
             "params": {"optimizer.lr": {"low": 0.01, "high": 0.1, "log": True}}}
    said, folder = [], tmp_path / "sweep"
    with pytest.raises(ConfigError, match="the sweep stopped: trial 0 failed: the objective "
                       "metric 'val_loss' is not logged by the job.* Did you mean 'val/loss'"):
        run_sweep(own_job(tmp_path, monkeypatch), table=table, sweep_dir=folder, log=said.append)
    study = optuna.load_study(study_name="own", storage=f"sqlite:///{folder / 'study.db'}")
    (trial,) = study.get_trials()  # no second trial started
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["steps"] == 4  # failed at its first validation, not trained on
    reason = trial.user_attrs["fail_reason"]
    logged = reason.split("which logs ")[1].split(". ")[0].split(", ")
    assert {"train/loss", "val/loss"} <= set(logged) and "val_loss" not in logged
    assert "Did you mean 'val/loss'?" in reason
    assert json.loads((folder / "trial_0000" / "sweep_result.json").read_text())["error"] == reason
    assert f"sweep: trial 0 failed: {reason}" in said  # the console
    assert reason in html.unescape((folder / "report.html").read_text())
    assert reason in (folder / "trial_0000" / "log.txt").read_text()  # the trial's own output
    # fixed, the same sweep runs its budget (the failed trial does not count) to val/loss
    table["objective"]["metric"], table["sweep"]["trials"] = "val/loss", 1
    study = run_sweep(own_job(tmp_path, monkeypatch), table=table, sweep_dir=folder,
                      log=lambda m: 0)
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "COMPLETE"]
    final = json.loads((folder / "trial_0001" / "sweep_result.json").read_text())
    assert final["error"] is None and study.get_trials()[1].value == final["value"]


@pytest.mark.timeout(180)
def test_a_rank_that_trains_with_another_learning_rate_fails_its_trial(tmp_path, monkeypatch):
    # rank 1 builds its optimizer with lr 0.5 (the dp trial of the demo's job, in the first
    # test, passes this check)
    table = {"objective": {"metric": "val/loss"}, "sweep": {"trials": 3, "concurrent": 1},
             "params": {"optimizer.lr": {"choices": [0.05]}}}
    folder = tmp_path / "sweep"
    with pytest.raises(ConfigError, match="rank 1's optimizer holds lr = 0.5 where rank 0's "
                       "holds 0.05"):
        run_sweep(own_job(tmp_path, monkeypatch), table=table, sweep_dir=folder,
                  log=lambda m: 0, overrides=["--quirk.rank1_lr=0.5", "--trainer.devices=2"])
    study = optuna.load_study(study_name="own", storage=f"sqlite:///{folder / 'study.db'}")
    (trial,) = study.get_trials()  # failed, and the sweep stopped
    assert trial.state.name == "FAIL" and trial.user_attrs["steps"] == 0
    reason = trial.user_attrs["fail_reason"]
    assert "rank 1's optimizer holds lr = 0.5 where rank 0's holds 0.05" in reason
    assert "Trainer holds" not in reason  # the settings are the same on both ranks
    result = json.loads((folder / "trial_0000" / "sweep_result.json").read_text())
    assert [r["optimizer"]["lr"] for r in result["ranks"]] == [[0.05], [0.5]]
