"""ProgressBar: plain lines for non-terminals, rich bar for terminals, silence when disabled."""

import io
from types import SimpleNamespace

import pytest

from meshtrain.errors import ConfigError
from meshtrain.observe.progress import ProgressBar, format_metrics


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_mode_prints_bounded_lines_and_final_step():
    out = io.StringIO()
    with ProgressBar(1003, stream=out, plain_interval_s=3600) as bar:
        assert not bar.rich_mode
        for step in range(1, 1001):
            bar.update(step, {"loss": 2.0 + 1 / step, "lr": 3e-4, "tokens_per_s": 12345.0})
        bar.log("val loss 1.95")
    lines = out.getvalue().splitlines()
    progress_lines = [ln for ln in lines if ln.startswith("step ")]
    # first update + one per 10% + final line
    assert 5 <= len(progress_lines) <= 13
    assert "val loss 1.95" in lines
    final = progress_lines[-1]
    assert final.startswith("step 1000/1003")
    assert "loss 2.001" in final and "lr 3.00e-04" in final and "12.3k tok/s" in final
    assert "| eta 0:00:00" in final


def test_plain_mode_time_trigger(monkeypatch):
    import meshtrain.observe.progress as progress

    clock = [0.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    out = io.StringIO()
    bar = ProgressBar(1000, stream=out, plain_interval_s=10).start()
    bar.update(1, {"loss": 1.0})
    clock[0] = 5.0
    bar.update(2, {"loss": 1.0})  # neither 10% nor 10 s: silent
    clock[0] = 12.0
    bar.update(3, {"loss": 1.0})  # 10 s passed: prints, with an eta from 2 steps in 12 s
    bar.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 1/1000", "step 3/1000"]
    assert lines[0].endswith("eta ?")
    assert lines[1].endswith("eta 1:39:42")  # 6 s/step * 997 steps = 5982 s


def test_disabled_prints_nothing():
    out = io.StringIO()
    with ProgressBar(10, enabled=False, stream=out) as bar:
        for step in range(1, 11):
            bar.update(step, {"loss": 1.0})
        bar.log("hello")
    assert out.getvalue() == ""


def test_rich_mode_on_terminal():
    out = FakeTTY()
    with ProgressBar(50, stream=out, refresh_per_second=20) as bar:
        assert bar.rich_mode
        for step in range(1, 51):
            bar.update(step, {"loss": 0.5, "tokens_per_s": 2.5e6})
        bar.log("validation done")
    text = out.getvalue()
    assert "validation done" in text
    assert "50/50" in text and "2.5M tok/s" in text


def test_format_metrics_and_bad_total():
    assert format_metrics({"grad_norm": 1.5, "loss": 2.0, "note": "x"}) == "loss 2 | grad_norm 1.5"
    with pytest.raises(ConfigError, match="total_steps"):
        ProgressBar(0)


@pytest.mark.timeout(120)
def test_a_fit_counts_tokens_for_token_ids_and_samples_otherwise(tmp_path, capsys):
    """Float inputs (no tokens) were shown and logged as tok/s (issue 26 item 10)."""
    import torch.nn.functional as F
    from conftest import quiet_trainer
    from parity import adamw, lm_loss, mlp, regression_data, tiny_gpt, token_data

    from meshtrain.observe.loggers import read_metrics_csv

    for name, model, data, loss, unit, shown in (
            ("mlp", mlp, regression_data(), F.mse_loss, "samples", "samples/s"),
            ("gpt", tiny_gpt, token_data(), lm_loss, "tokens", "tok/s")):
        run_dir = tmp_path / name
        trainer = quiet_trainer(run_dir, max_steps=2, micro_batch_size=8, progress_bar=True,
                                loggers=("csv",))
        trainer.fit(model, data, optimizer=adamw, loss_fn=loss)
        out = capsys.readouterr().out
        step_lines = [line for line in out.splitlines() if line.startswith("step 2/2")]
        assert step_lines and f" {shown} " in step_lines[-1] + " ", out
        logged = set().union(*(row.keys() for row in read_metrics_csv(run_dir / "metrics.csv")))
        other = {"samples": "tokens", "tokens": "samples"}[unit]
        assert f"train/{unit}_per_s" in logged and f"train/{other}_per_s" not in logged


def test_through_a_logger_every_handler_gets_the_lines_and_the_terminals_print_above_the_bar():
    """With ``logger=``: plain lines and ``log()`` go through it; while the rich bar is live a
    handler writing to its terminal prints through the bar (cleared, line, redrawn), another
    handler gets the lines as they are; both are the logger's own again after ``close()``."""
    import logging

    logger = logging.getLogger("test_progress.bar")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tty, kept = FakeTTY(), []
    terminal = logging.StreamHandler(tty)
    terminal.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    keep = logging.Handler()
    keep.emit = lambda record: kept.append(record.getMessage())
    logger.handlers = [terminal, keep]
    try:
        with ProgressBar(50, stream=tty, refresh_per_second=20, logger=logger) as bar:
            assert bar.rich_mode
            for step in range(1, 51):
                bar.update(step, {"loss": 0.5})
                if step == 25:
                    logger.info("step 25: val/loss 0.4")
            bar.log("from the bar")
        assert logger.handlers == [terminal, keep]
        logger.info("after the bar")
        text = tty.getvalue()
        for line in ("INFO step 25: val/loss 0.4", "INFO from the bar"):
            assert text.count(line) == 1, text
            assert text[:text.index(line)].endswith("\x1b[2K"), text  # the bar cleared first
            assert "step" in text[text.index(line) + len(line):]  # and drawn again below
        assert text.endswith("INFO after the bar\n")
        assert kept == ["step 25: val/loss 0.4", "from the bar", "after the bar"]

        out = io.StringIO()  # not a terminal: the plain lines go through the logger too
        kept.clear()
        with ProgressBar(4, stream=out, logger=logger) as bar:
            for step in range(1, 5):
                bar.update(step, {"loss": 0.5})
        assert out.getvalue() == ""
        assert [line.split(" |")[0] for line in kept] == ["step 1/4", "step 2/4", "step 3/4",
                                                          "step 4/4"]
    finally:
        logger.handlers = []
