"""Resuming mid-epoch on token shards at another world size continues with exactly the next
sequences (issue 14): a checkpoint saved by dp=2 after 3 steps, resumed by one process, reads in
step 4 the same packed sequences as one process that never stopped."""


import pytest
import torch

from meshtrain import Callback, Trainer
from meshtrain.data.tokens import PackedTokens, TokenShardWriter
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 50, 8


class Recorded(PackedTokens):
    """PackedTokens that remembers the sequences it handed out, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed_out: list[torch.Tensor] = []

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        self.handed_out.append(sample[0])
        return sample


class StepBatches(Callback):
    """The sequences read during each optimizer step (this rank's)."""

    def __init__(self, dataset: Recorded):
        self.dataset, self.steps, self.seen = dataset, [], 0

    def on_train_step_end(self, trainer, metrics: dict) -> None:
        self.steps.append(torch.stack(self.dataset.handed_out[self.seen:]))
        self.seen = len(self.dataset.handed_out)


def write_shards(folder) -> None:
    gen = torch.Generator().manual_seed(0)
    with TokenShardWriter(folder, VOCAB, eos_id=VOCAB - 1, tokenizer_sha256="test",
                          shard_tokens=97) as writer:  # several shards, documents across them
        for _ in range(40):
            length = int(torch.randint(3, 30, (1,), generator=gen))
            writer.add_document(torch.randint(0, VOCAB - 1, (length,), generator=gen).tolist())


def fit(folder, run_dir, layout, max_steps, resume=None, checkpoint_every=None):
    torch.set_num_threads(1)
    data = Recorded(folder, SEQ)
    steps = StepBatches(data)
    trainer = Trainer(layout=layout, max_steps=max_steps, global_batch_size=8, seed=0,
                      run_dir=run_dir, loggers=(), progress_bar=False, callbacks=[steps],
                      resume=resume, checkpoint_every_n_steps=checkpoint_every)
    trainer.fit(lambda: GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=2,
                                      d_model=16)),
                data, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                loss_fn=_loss)
    return steps.steps


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.timeout(200)
def test_resume_on_another_world_size_reads_the_next_sequences(tmp_path):
    write_shards(tmp_path / "shards")
    assert len(PackedTokens(tmp_path / "shards", SEQ)) > 4 * 8  # step 4 is mid-epoch
    reference = fit(tmp_path / "shards", tmp_path / "ref", None, 4)
    run_workers(fit, 2, (tmp_path / "shards", tmp_path / "a", "dp=2", 3, None, 3), timeout=120)
    checkpoint = tmp_path / "a" / "checkpoints" / "final"  # saved after step 3
    resumed = fit(tmp_path / "shards", tmp_path / "b", None, 4, resume=str(checkpoint))
    assert len(resumed) == 1  # only step 4 ran
    assert torch.equal(resumed[0], reference[3])
    # the steps read different sequences: a resume that lost its place would differ
    assert not any(torch.equal(reference[3], reference[i]) for i in range(3))
