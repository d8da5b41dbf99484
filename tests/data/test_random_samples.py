"""A dataset that draws random numbers for each sample (augmentation, noise, random crops) gives
the same sample to every rank that reads it: the ranks of a tensor- or context-parallel group
compute one sample together, so their draws must agree, in the loader's worker processes
(seeded per data-parallel rank) as in the main process (the random stream those ranks share).
The job is a script started with ``python`` (``devices=2``: loader workers need ranks that
may have children)."""

import pytest
import torch
from conftest import ROOT, run_script
from parity import lm_loss
from torch.utils.data import Dataset

from meshtrain import ConfigError, Trainer
from meshtrain.models.gpt import GPT, GPTConfig

SCRIPT = """
import os, sys
import torch
from torch.utils.data import Dataset
from meshtrain import Trainer
from meshtrain.models.gpt import GPT, GPTConfig

folder, layout, num_workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
(__import__("pathlib").Path(folder) / f"{os.getpid()}.pid").write_text(str(os.getpid()))


class Drawn(Dataset):
    # each sample's tokens drawn when it is read; every read written down by rank
    def __len__(self):
        return 32

    def __getitem__(self, index):
        tokens = torch.randint(0, 64, (17,))
        rank = os.environ.get("RANK", "-before-start")
        with open(os.path.join(folder, f"rank{rank}"), "a") as out:
            out.write(f"{index} {tokens.tolist()}\\n")
        return tokens[:-1], tokens[1:]


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


if __name__ == "__main__":
    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, d_model=16,
                       dropout=0.1)
    trainer = Trainer(layout=layout, devices=2, max_steps=3, global_batch_size=4, loggers=(),
                      report=False, progress_bar=False, checkpoint_every_n_steps=None,
                      model_summary=False, num_workers=num_workers, shuffle=False,
                      root_dir=os.path.join(folder, "runs"))
    trainer.fit(lambda: GPT(config), Drawn(), loss_fn=loss_fn,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout, num_workers", [("tp=2", 1), ("cp=2", 1), ("cp=2", 0),
                                                 ("pp=2", 1)])
def test_the_ranks_that_read_a_sample_draw_it_alike(tmp_path, layout, num_workers):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = run_script(script, tmp_path, layout, num_workers, cwd=ROOT, pid_dir=tmp_path,
                     timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    # each sample's last draw (the one trained on: a rank's own pre-start check may read the
    # first samples before), over the samples both ranks read (the loader's prefetch may differ)
    first, second = (dict(line.split(" ", 1) for line in (tmp_path / f"rank{r}").read_text()
                          .splitlines()) for r in (0, 1))
    both = first.keys() & second.keys()
    assert len(both) >= 12 and all(first[i] == second[i] for i in both)


class Drawn(Dataset):
    """Each sample's tokens drawn when it is read."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        tokens = torch.randint(0, 64, (17,))
        return tokens[:-1], tokens[1:]


def test_under_pp_such_a_dataset_read_in_the_main_process_is_refused_before_start():
    """Each pipeline stage reads the sample itself, and in the main process the stages' random
    streams part (each stage's dropout draws differently): refused, with the fix."""
    def check(**settings):
        Trainer(layout="pp=2", devices=2, global_batch_size=4, max_steps=1, **settings).check(
            lambda: GPT(config), Drawn(), loss_fn=lm_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05))

    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, d_model=16)
    with pytest.raises(ConfigError, match=r"Drawn\[0\] gives another sample each time it is "
                                          r"read.*Set num_workers=1"):
        check()
    check(num_workers=1)
