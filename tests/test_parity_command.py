"""`meshtrain parity`: a user's job trained in one process and under each layout, compared."""

from __future__ import annotations

import math

import pytest
import torch
from parity_models import TP_USER_BLOCK

from meshtrain import cli
from meshtrain.errors import ConfigError
from meshtrain.parity import Row, Source, compare, layout_world_size, parity

pytestmark = pytest.mark.timeout(300)

# the main example, made tiny: a 1-layer GPT on 20k characters, 3 steps
CHAR = ["examples/char_gpt.toml", "--model.num_layers=1", "--model.d_model=32",
        "--data.max_chars=20000", "--data.seq_len=16", "--trainer.global_batch_size=8"]


def test_char_gpt_layouts_match_one_process(capsys):
    code = cli.main(["parity", *CHAR[:1], "--layouts", "dp=2;tp=2", "--steps", "3", *CHAR[1:]])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("dp=2 ", "tp=2 "))]
    assert code == 0, out
    assert len(rows) == 2 and all(line.rstrip().endswith("ok") for line in rows), out
    assert "2 of 2 layouts train like one process" in out


def test_dropout_diverges_and_exits_nonzero(capsys):
    """Dropout draws different masks on each rank than the one process does: the runs part at
    the first step, and the command says so and fails."""
    code = cli.main(["parity", *CHAR, "--model.dropout=0.2", "--layouts", "dp=2", "--steps", "2"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dp=2 "))
    cells = [cell.strip() for cell in row.split("|")]
    assert cells[4] == "1" and cells[-1].startswith("FAIL"), out
    assert code == 1


def test_entry_point_and_refused_layout():
    """A Python entry point (the tests' regression MLP); a layout the framework refuses is a
    failed row with the reason, not a crash, and the other rows still run."""
    rows = parity(Source("parity:regression_job"), ["zero3=2", "zero1=2,tp=2"], 4,
                  out=lambda *a: None)
    good, refused = rows
    assert good.ok and good.max_param_diff <= 1e-5 and good.first_divergence is None
    assert good.worst_param.endswith(("weight", "bias"))
    assert not refused.ok and "refused before start" in refused.error and "zero1" in refused.error
    assert good.rel64 <= 1e-9 and not good.fp32_verdict  # judged in float64


def test_a_layout_the_model_refuses_starts_no_process_and_is_said_once(monkeypatch):
    """The model's own refusal (no tp plan for the MLP) comes from the checks `fit` makes
    before start: the row says so and no process of that layout starts (before, each of its
    ranks started and printed the same error)."""
    import meshtrain.launch.spawn as spawn

    started, run_workers = [], spawn.run_workers

    def counting(fn, num_workers, *args, **kwargs):
        started.append(num_workers)
        return run_workers(fn, num_workers, *args, **kwargs)

    monkeypatch.setattr(spawn, "run_workers", counting)
    row, = parity(Source("parity:regression_job"), ["tp=2"], 2, out=lambda *a: None)
    assert "refused before start" in row.error and "no tensor-parallel plan" in row.error, row
    assert all(n == 1 for n in started), started  # the one-process references only


def test_one_layout_with_commas_is_said_to_be_one():
    """`--layouts "dp=2,tp=2"` (a comma where ';' was meant) is one 4-process layout: the plan
    line says so and how to write two."""
    lines = []  # (the regression MLP has no tp plan: both refused before start, nothing runs)
    row, = parity(Source("parity:regression_job"), ["dp=2,tp=2"], 2, out=lines.append)
    assert "separated by ';'" in lines[0] and '"dp=2;tp=2" is two' in lines[0], lines
    assert row.ranks == 4
    lines.clear()
    parity(Source("parity:regression_job"), ["dp=2,tp=2", "zero1=2,tp=2"], 1, out=lines.append)
    assert "separated by ';'" not in lines[0]


def test_compare_names_first_step_and_worst_parameter():
    reference = {"params": {"a": torch.zeros(3), "b": torch.zeros(2)},
                 "losses": torch.tensor([1.0, 0.9, 0.8, 0.7], dtype=torch.float64),
                 "grad_norms": torch.ones(4, dtype=torch.float64)}
    run = {"params": {"a": torch.tensor([0.0, 3e-5, 0.0]), "b": torch.tensor([1e-6, 0.0])},
           "losses": torch.tensor([1.0, 0.9, 0.8 + 2e-5, 0.7], dtype=torch.float64),
           "grad_norms": torch.ones(4, dtype=torch.float64), "seconds": 1.0}
    row = compare(reference, run, Row("dp=2", 2))
    assert row.first_divergence == 3 and row.worst_param == "a"
    assert math.isclose(row.max_param_diff, 3e-5, rel_tol=1e-3) and not row.ok
    run["grad_norms"] = torch.tensor([1.0, 1.5, 1.0, 1.0], dtype=torch.float64)
    assert compare(reference, run, Row("dp=2", 2)).first_divergence == 2  # norms count too
    run["params"] = {"a": torch.zeros(3)}
    assert "missing ['b']" in compare(reference, run, Row("dp=2", 2)).error


def test_command_line_mistakes(capsys):
    assert cli.main(["parity", "examples/char_gpt.toml"]) == 2
    assert "--layouts" in capsys.readouterr().err
    assert cli.main(["parity", "--layouts", "dp=2"]) == 2
    assert cli.main(["parity", "nosuchmodule:job", "--layouts", "dp=2"]) == 2
    assert "cannot import 'nosuchmodule'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no 'auto'"):
        layout_world_size("dp=auto,tp=2")
    assert layout_world_size("pp=2,tp=2,dp_shard=2") == 8
    assert layout_world_size("ps=2,dp=3") == 5  # servers beside the workers
    # ep borrows data-parallel ranks (before, multiplied in: dp_shard=2,ep=2 asked for 4 and
    # was refused "needs 2 processes"); alone it stands for dp=E
    assert layout_world_size("dp_shard=2,ep=2") == 2 and layout_world_size("ep=2") == 2
    assert layout_world_size("pp=2,ep=2") == 4
    assert layout_world_size("dp_replicate=2,dp_shard=2,ep=4") == 4


def test_batch_coupled_jobs_are_reported_correctly():
    """A BatchNorm model and a padded token-mean loss (issue 13): equal to one process with
    synchronised statistics and a global-mean loss; per-rank statistics, or a per-micro-batch
    mean, differ and are reported as such; where the layout cuts each step into micro-batches
    the verdict says whether one process cut the same way is equal."""
    quiet = {"out": lambda *a: None}
    good = parity(Source("parity:batchnorm_job"), ["dp=2", "zero3=2"], 4, **quiet)
    good += parity(Source("parity:padded_lm_job"), ["dp=2", "pp=2"], 4, **quiet)
    assert all(row.ok and row.first_divergence is None for row in good), good
    per_rank, = parity(Source("parity:batchnorm_job", ("--parallel.sync_batchnorm=false",)),
                       ["dp=2"], 4, **quiet)
    plain, = parity(Source("parity:padded_lm_plain_job"), ["dp=2"], 4, **quiet)
    for row in (per_rank, plain):
        assert not row.ok and row.first_divergence == 1 and not row.error, row
        assert row.max_param_diff > 1e-4
        assert not row.note  # (dp=2 does not cut a step into micro-steps: no other verdict)
    # a pipeline cuts each step into micro-batches: the per-micro-batch mean then differs from
    # one process on the whole batch, and equals one process cut the same way (the job's
    # difference, said as such; meshtrain's MoE balancing per micro-step under pp likewise)
    cut, = parity(Source("parity:padded_lm_plain_job"), ["pp=2"], 4, **quiet)
    assert not cut.ok and cut.first_divergence == 1, cut
    assert cut.note.startswith("equal") and "micro-batches of 8" in cut.note, cut.note


TP_PLAN_JOB = """
from meshtrain.parallel.tensor import attention_plan, mlp_plan
""" + TP_USER_BLOCK + """

PLAN = {**attention_plan("attn", "q", "k", "v", "out"), **mlp_plan("", "fc_in", "fc_out")}


def job():
    return dict(model=Block, train_data=data(),
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                loss_fn=torch.nn.functional.mse_loss,
                settings=dict(global_batch_size=16, tp_plan=PLAN))
"""


@pytest.mark.usefixtures("one_thread")
def test_a_job_with_its_own_tp_plan_checks_against_one_process(tmp_path, monkeypatch, capsys):
    """`meshtrain parity my_module:job` where the job's settings hold a hand-written tp_plan
    (the documented way to check a plan): the one-process reference and dp=2 train without it
    (it needs tp), tp=2 uses it, and all match."""
    (tmp_path / "tp_plan_job.py").write_text(TP_PLAN_JOB)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["parity", "tp_plan_job:job", "--layouts", "dp=2;tp=2", "--steps", "3"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith(("dp=2 ", "tp=2 "))}
    assert code == 0, out
    assert set(rows) == {"dp=2", "tp=2"} and all(r.rstrip().endswith("ok") for r in rows.values())
    assert "2 of 2 layouts train like one process" in out


def test_each_run_leaves_out_the_settings_its_layout_has_no_use_for():
    from meshtrain.parity import run_settings

    job = {"settings": {"tp_plan": {}, "comm_hook": "powersgd", "powersgd_rank": 2,
                        "pp_schedule": "gpipe", "global_batch_size": 16}}
    single = run_settings(job, None, 3, "/tmp/x")
    assert not {"tp_plan", "comm_hook", "powersgd_rank", "pp_schedule"} & set(single)
    assert single["global_batch_size"] == 16 and single["max_steps"] == 3
    assert {"comm_hook", "powersgd_rank"} <= set(run_settings(job, "dp=2", 3, "/tmp/x"))
    assert "tp_plan" in run_settings(job, "tp=2", 3, "/tmp/x")
    assert "pp_schedule" in run_settings(job, "pp=2,tp=2", 3, "/tmp/x")
    # a user's mistake is not dropped, the Trainer refuses it: powersgd_rank without comm_hook
    mistake = {"settings": {"powersgd_rank": 2}}
    assert run_settings(mistake, "dp=2", 3, "/tmp/x")["powersgd_rank"] == 2


MISTAKE_JOB = """
import torch
from torch.utils.data import TensorDataset


def job():
    x = torch.randn(32, 4)
    return dict(model=lambda: torch.nn.Linear(4, 2), train_data=TensorDataset(x, x[:, :2]),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                loss_fn=torch.nn.functional.mse_loss,
                settings=dict(global_batch_size=8, powersgd_rank=2))  # without comm_hook


def one_process_fails():
    import os

    def model():
        if os.environ.get("WORLD_SIZE") == "1":
            raise RuntimeError("this model cannot be built in one process")
        return torch.nn.Linear(4, 2)
    return {**job(), "model": model, "settings": dict(global_batch_size=8)}
"""


def test_a_setting_that_does_nothing_anywhere_is_a_row_error_not_a_crash(tmp_path, monkeypatch,
                                                                        capsys):
    """powersgd_rank without comm_hook='powersgd' does nothing under any layout: it is not
    left out quietly but refused, as each row's error, and the command ends with exit 1; so is
    a one-process reference that fails."""
    (tmp_path / "mistake_job.py").write_text(MISTAKE_JOB)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["parity", "mistake_job:job", "--layouts", "dp=2", "--steps", "2"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dp=2 "))
    assert code == 1 and "refused before start" in row and "powersgd_rank=2" in row, out
    # a reference that fails in its process: every row says so, no traceback ends the command
    code = cli.main(["parity", "mistake_job:one_process_fails", "--layouts", "dp=2", "--steps",
                     "2"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dp=2 "))
    assert code == 1 and "the one-process reference failed" in row, out
    assert "cannot be built in one process" in row, out
