"""The report a fit leaves (meshtrain/observe/report/): written at the end of fit, and after a
failure with what the run had, through the Trainer as a user calls it; a real fit's report
opened in headless Chromium."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch.utils.data import TensorDataset

import meshtrain
from meshtrain.checkpoint.manager import checkpoint_name
from meshtrain.observe import run_files
from meshtrain.observe.loggers import read_metrics_csv
from meshtrain.observe.report import figures
from meshtrain.observe.report.collect import collect

SECTIONS = ("summary", "config", "environment", "loss", "throughput", "breakdown", "memory",
            "experts", "pipeline", "events", "traces", "missing")
PNG = '<img src="data:image/png;base64,'


class FailsAt(torch.nn.Module):
    """A regression model whose forward raises at call ``fail_at`` (None: never)."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the data went bad at this batch")
        return self.net(x)


def _data():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


def _sections(html: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="([a-z]+)"[^>]*>(.*?)</section>', html, re.S))


def _text(html: str) -> str:
    """The visible text, tags removed and spaces collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


@pytest.mark.usefixtures("one_thread")
def test_fit_writes_the_report_with_every_section(tmp_path, capsys):
    trainer = quiet_trainer(tmp_path, max_steps=8, log_every_n_steps=2, loggers=("csv",),
                            report=True)
    trainer.fit(FailsAt(), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                loss_fn=F.mse_loss)
    page = tmp_path / "report.html"
    found = _sections(page.read_text())
    assert set(SECTIONS) <= set(found)
    # a Trainer used from Python has no config.toml: the settings it recorded are shown
    assert "<td>max_steps</td><td><code>8</code></td>" in found["config"]
    run = collect(tmp_path)
    assert run.status == "finished" and [r["step"] for r in run.breakdown] == [2, 4, 6, 8]
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"report: {page}"  # the last line fit prints
    # the run's summary before it: steps, throughput, the final metrics
    summary = next(i for i, line in enumerate(out) if line.startswith("fit: 8 steps in "))
    assert "samples/s over the training steps" in out[summary]
    loss = trainer.callback_metrics["train/loss"]
    assert out[summary + 1].startswith(f"final: train/loss {loss:.4g}")


@pytest.mark.usefixtures("one_thread")
def test_a_failed_fit_leaves_a_partial_report_with_its_error(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=8, log_every_n_steps=2, loggers=("csv",),
                            report=True)
    with pytest.raises(RuntimeError, match="went bad"):
        trainer.fit(FailsAt(fail_at=5), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                    loss_fn=F.mse_loss)
    run = collect(tmp_path)
    assert run.status == "failed" and "the data went bad" in run.error
    assert [r["step"] for r in run.breakdown] == [2, 4]  # what it had measured
    kinds = [e["kind"] for e in run_files.read_events(tmp_path)]
    assert kinds == ["failure"]
    found = _sections((tmp_path / "report.html").read_text())
    assert "failed" in found["summary"] and "the data went bad" in found["summary"]


@pytest.mark.usefixtures("one_thread")
def test_the_summary_names_the_best_checkpoint(tmp_path, capsys):
    from meshtrain import ModelCheckpoint

    best = ModelCheckpoint(monitor="val/loss", save_last=False)
    trainer = quiet_trainer(tmp_path, max_steps=6, val_every_n_steps=2, callbacks=[best])
    trainer.fit(FailsAt(), _data(), _data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                loss_fn=F.mse_loss)
    score = best.best_k[best.best_model_path]
    assert f"best checkpoint: {best.best_model_path} (val/loss {score:.4g})" in \
        capsys.readouterr().out
    # the best-k folders a better one replaced are gone, and said so: not missing
    removed = [e for e in run_files.read_events(tmp_path) if e["kind"] == "removed"]
    assert removed and best.best_model_path.is_dir()
    for event in removed:
        assert event["path"].startswith("checkpoints/best_step_")
        assert not (tmp_path / event["path"]).exists()
        assert "no longer among the best 1 (ModelCheckpoint's save_top_k)" in event["message"]
    assert not any("best_step" in sentence for sentence in collect(tmp_path).missing)


def _pp_summary_rank(run_dir):
    from parity import GPT4_FNS

    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="pp=2", max_steps=1, micro_batch_size=4,
                            model_summary=True)
    trainer.fit(GPT4_FNS["model_fn"], GPT4_FNS["data_fn"](), optimizer=GPT4_FNS["optimizer_fn"],
                loss_fn=GPT4_FNS["loss_fn"])


@pytest.mark.timeout(120)
def test_the_model_summary_counts_what_each_rank_holds(tmp_path, capfd):
    from parity import GPT4_FNS

    from meshtrain.launch.spawn import run_workers

    run_workers(_pp_summary_rank, 2, (str(tmp_path),), timeout=100)
    out = capfd.readouterr().out
    total = sum(p.numel() for p in GPT4_FNS["model_fn"]().parameters())
    found = re.search(r"held per rank under the layout: rank 0: ([\d,]+), rank 1: ([\d,]+)", out)
    assert found, out
    first, second = (int(g.replace(",", "")) for g in found.groups())
    assert first + second == total and first != second  # two pipeline stages, each its own


class Classifier(meshtrain.TrainingModule):
    """A user's module: a linear classifier, its accuracy logged with self.log."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.net(x)

    def _step(self, batch, name: str):
        x, y = batch
        logits = self(x)
        self.log(name, (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train/acc")

    def validation_step(self, batch, batch_idx):
        return self._step(batch, "val_acc")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, one_thread_per_module):
    """A real fit that leaves its run folder as `make demo` does (its defaults: the report,
    the final checkpoint), shrunk to 1 process and 6 steps: checkpoints every 2 steps with
    keep_last_k = 1 (the demo: every 100 of 400, 2 kept), validation every 3. The run folder,
    the Trainer and what fit printed."""
    root = tmp_path_factory.mktemp("runs")
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x.sum(1) > 0).long())
    trainer = meshtrain.Trainer(
        root_dir=str(root), name="tiny", accelerator="cpu", seed=0, max_steps=6,
        global_batch_size=16, log_every_n_steps=1, val_every_n_steps=3,
        checkpoint_every_n_steps=2, keep_last_k=1, loggers=("csv",), progress_bar=False)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        trainer.fit(Classifier(), data, TensorDataset(*data[:32]))
    assert (trainer.run_dir / "report.html").is_file()
    return trainer.run_dir, trainer, out.getvalue()


def test_the_lines_fit_ends_with_name_the_users_metrics(real_run):
    _, trainer, out = real_run
    (final,) = [line for line in out.splitlines() if line.startswith("final: ")]
    for name in ("train/loss", "val/loss", "train/acc", "val_acc"):
        assert f"{name} {trainer.callback_metrics[name]:.4g}" in final, final
    assert "samples_per_s" not in final and "epoch" not in final


def test_a_real_runs_report_tells_rotated_checkpoints_from_missing_ones(real_run):
    run, _, _ = real_run
    found = _sections((run / "report.html").read_text())
    # step 2's removed by the checkpoint writer once step 4's was saved (step 6's is final/)
    name = f"checkpoints/{checkpoint_name(2)}"
    assert not (run / name).exists() and (run / "checkpoints" / checkpoint_name(4)).is_dir()
    assert f"{name} (removed: rotated away by keep_last_k = 1" in _text(found["events"])
    assert "step_" not in found["missing"]


def test_a_cpu_runs_memory_limit_is_its_nodes_shared_by_its_ranks(real_run):
    from meshtrain.observe.memory.limit import host_memory_limit

    run, _, _ = real_run
    limit, source = host_memory_limit()
    env = run_files.read_json(run / run_files.ENVIRONMENT)
    assert (env["memory_limit_scope"], env["memory_limit_source"]) == ("node", source)
    assert {row["mem_limit_bytes"] for row in run_files.read_breakdown(run)} == {limit}
    memory = _text(_sections((run / "report.html").read_text())["memory"])
    assert f"the limit is the node's ({source}), not each rank's" in memory


def chromium_console(page: Path) -> tuple[str, list[str]]:
    """The DOM headless Chromium builds from ``page``, and the console lines it logged (a
    JavaScript error, a figure that does not decode)."""
    out = subprocess.run(
        ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_a_real_runs_report_opens_in_headless_chromium_with_its_loss_and_metrics(real_run,
                                                                                  tmp_path):
    run, trainer, _ = real_run
    dom, console = chromium_console(run / "report.html")
    assert console == []  # no JavaScript error, every figure decoded
    found = _sections(dom)
    assert tuple(found) == SECTIONS
    summary = _text(found["summary"])
    metrics = read_metrics_csv(run / "metrics.csv")
    losses = [row["train/loss"] for row in metrics if row.get("train/loss") is not None]
    assert len(losses) == 6 and "status finished" in summary and "steps 6 of 6" in summary
    assert f"final train loss {losses[-1]:.4g}" in summary
    for name in ("train/acc", "val_acc"):  # logged by the user's module
        assert f"final {name} {trainer.callback_metrics[name]:.4g} (step 6)" in summary
    # the loss figure the browser shows is the one drawn from this run's metrics.csv
    assert re.findall(r'<img src="([^"]+)" alt="loss"', found["loss"]) == [
        figures.loss_figure(metrics)]
    assert "Straggler" not in dom and "One rank:" in _text(found["breakdown"])
    html = (run / "report.html").read_text()
    broken = tmp_path / "broken.html"  # a figure that does not decode is caught
    broken.write_text(html.replace(PNG, PNG + "AAAA", 1))
    _, console = chromium_console(broken)
    assert len(console) == 1 and "broken figure: loss" in console[0], console
