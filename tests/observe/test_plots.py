"""Plots write real PNG files."""

import math

import pytest

from meshtrain.errors import ConfigError
from meshtrain.observe.plots import plot_loss_curves, plot_lr_find

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE


def test_loss_curves_png(tmp_path):
    rows = [{"step": s, "train/loss": 3.0 / s, "val/loss": None} for s in range(1, 50)]
    rows += [{"step": 10, "val/loss": 0.5}, {"step": 20, "train/loss": None, "val/loss": 0.3},
             {"step": 30, "train/loss": math.nan}]
    out = plot_loss_curves(rows, tmp_path / "sub" / "loss.png", title="tiny run")
    assert out == tmp_path / "sub" / "loss.png"
    assert_png(out)


def test_loss_curves_without_values_still_writes(tmp_path):
    assert_png(plot_loss_curves([], tmp_path / "empty.png"))


def test_lr_find_png(tmp_path):
    lrs = [1e-6 * 10 ** (i / 10) for i in range(50)]
    losses = [3.0 - 0.02 * i if i < 40 else 3.0 + (i - 40) ** 2 for i in range(50)]
    losses[-1] = math.inf
    out = plot_lr_find(lrs, losses, 1e-3, tmp_path / "lr.png")
    assert_png(out)
    assert_png(plot_lr_find(lrs, losses, None, tmp_path / "lr_none.png"))


def test_lr_find_rejects_mismatched_lengths(tmp_path):
    with pytest.raises(ConfigError, match="one loss per learning rate"):
        plot_lr_find([1e-3, 1e-2], [1.0], None, tmp_path / "x.png")
