"""The README's first Python example, run as a user runs it: the code block copied out of README.md
into a script started with plain ``python`` (it asks for ``devices=2``: the script starts its second
rank itself), behind a few lines that define what the README leaves to the reader (``MyModel``,
the datasets). Only its step counts are shortened. (It found the README's ``lr_find`` call
without the ``loss_fn`` a model returning predictions needs.)"""

import json
import re

import pytest
from conftest import ROOT, run_script

PRELUDE = """
import json, os, sys
import torch
from torch.utils.data import TensorDataset

(__import__("pathlib").Path(sys.argv[1]) / f"{os.getpid()}.pid").write_text(str(os.getpid()))


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def classes(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :4] * 2).argmax(1))


train_dataset, val_dataset, test_dataset = classes(512, 0), classes(128, 1), classes(64, 2)
inputs_dataset = TensorDataset(classes(20, 3).tensors[0])
"""

POSTLUDE = """
if trainer.is_global_zero:
    report = {"val": trainer.callback_metrics.get("val/loss"), "steps": trainer.global_step,
              "outputs": len(outputs), "lr": result.suggested_lr if result is not None else None,
              "class": type(model).__name__}
    (__import__("pathlib").Path(sys.argv[1]) / "report.json").write_text(json.dumps(report))
"""


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(300)
def test_the_readmes_python_example_runs_as_written(tmp_path):
    code = readme_example()
    assert "MyModel()," in code and 'layout="dp=2", devices=2' in code  # the example we mean
    code = code.replace("max_steps=1000", "max_steps=40").replace(
        "val_every_n_steps=100", "val_every_n_steps=20").replace(
        "CosineAnnealingLR(opt, 1000)", "CosineAnnealingLR(opt, 40)")
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + code + POSTLUDE)
    done = run_script(script, tmp_path, cwd=tmp_path, pid_dir=tmp_path, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["class"] == "MyModel" and report["outputs"] == 20
    assert report["steps"] == 40 and 0 < report["val"] < 10  # validated (at 20 and the end)
    assert report["lr"] is not None and report["lr"] > 0
    assert len(list(tmp_path.glob("*.pid"))) == 2  # two processes ran it
