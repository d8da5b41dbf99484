"""FLOPs per token for a model that states none: torch's FlopCounterMode over one forward and
backward of a meta-device copy (meshtrain/observe/flops.py), against the GPT's own formula."""

import pytest
import torch

from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.observe.flops import counted_flops_per_item, flops_per_item


def test_counted_flops_match_the_gpt_formula():
    config = GPTConfig(vocab_size=64, seq_len=32, num_layers=4, d_model=64, num_heads=4)
    with torch.device("meta"):
        model = GPT(config)
    own = model.flops_per_token(32)  # 6 x matmul parameters + 12 L d T (attention)
    counted = counted_flops_per_item(model, torch.zeros(2, 32, dtype=torch.long))
    assert abs(counted / own - 1) < 0.03, (counted, own)
    attention = 12 * 4 * 64 * 32
    assert counted > own - attention / 2  # the attention is in the count, not only 6 x params


class NoFormula(torch.nn.Module):
    """A model with attention and no flops_per_token of its own."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=64, seq_len=32, num_layers=4, d_model=64,
                                 num_heads=4))

    def forward(self, idx):
        return self.gpt(idx)


def test_a_model_without_its_own_count_is_counted_not_estimated():
    with torch.device("meta"):
        meta = NoFormula()
    sample = torch.zeros(2, 32, dtype=torch.long)
    counted = flops_per_item(meta, meta_model=meta, sample=sample)
    assert counted == counted_flops_per_item(meta, sample)
    assert counted > flops_per_item(meta) * 1.05  # 6 x params misses the attention
    assert flops_per_item(meta, meta_model=meta, sample=None) == flops_per_item(meta)


def test_a_compiled_model_is_counted_as_its_eager_self():
    """A user's torch.compile(model) object: counted eagerly (no meta graph compiled, no
    torch warning about the counter's global hooks), the same FLOPs."""
    import warnings

    with torch.device("meta"):
        meta = NoFormula()
    sample = torch.zeros(2, 32, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert counted_flops_per_item(torch.compile(meta), sample) == \
            counted_flops_per_item(meta, sample)


class Tokens(torch.utils.data.Dataset):
    """Token rows as (inputs, targets) pairs, or as a Hugging Face batch's dicts with a
    padding mask (whose values transformers' mask code reads)."""

    def __init__(self, as_dict=False):
        self.rows, self.as_dict = torch.randint(0, 64, (32, 33)), as_dict

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        if self.as_dict:
            return {"input_ids": row[:-1], "labels": row[:-1],
                    "attention_mask": torch.ones(32, dtype=torch.long)}
        return row[:-1], row[1:]


def _fitted_flops(tmp_path, model, data, **kwargs) -> float:
    import json

    from conftest import quiet_trainer

    from meshtrain.observe import run_files

    trainer = quiet_trainer(tmp_path, devices=1, max_steps=2, log_every_n_steps=1,
                            global_batch_size=4)
    trainer.fit(model, data, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), **kwargs)
    env = json.loads((trainer.run_dir / run_files.ENVIRONMENT).read_text())
    return env["flops_per_item"]


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", ["object", "factory"])
def test_the_trainer_counts_a_model_that_states_no_flops(tmp_path, given):
    """The Trainer's MFU for a model without flops_per_token: counted on its first batch's
    shapes (attention included), not 6 x parameters; a model object or a factory."""
    torch.manual_seed(0)
    model = NoFormula() if given == "object" else NoFormula
    counted = _fitted_flops(tmp_path, model, Tokens(), loss_fn=_lm_loss)
    own = NoFormula().gpt.flops_per_token(32)
    assert abs(counted / own - 1) < 0.03, (counted, own)
    assert counted > flops_per_item(NoFormula()) * 1.05


@pytest.mark.timeout(120)
def test_a_hugging_face_factory_with_a_padding_mask_is_counted(tmp_path):
    """A plain ``lambda: LlamaForCausalLM(cfg)`` fed dict batches with ``attention_mask``: the
    mask's values cannot be read on meta, so it is counted without it (SDPA costs the same)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    counted = _fitted_flops(tmp_path, lambda: transformers.LlamaForCausalLM(cfg),
                            Tokens(as_dict=True))
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    matmuls = sum(p.numel() for n, p in meta.named_parameters() if "embed" not in n)
    attention = 12 * 2 * 64 * 32  # 12 L d T
    assert abs(counted / (6 * matmuls + attention) - 1) < 0.03, counted


def test_counting_leaves_the_random_stream_of_training_alone():
    """The count builds the model again on rank 0 mid-run: a factory that seeds (a user's
    ``torch.manual_seed(0)`` inside it) must not reset the stream dropout draws from."""
    from meshtrain.observe.flops import FirstBatchCount

    def factory():
        torch.manual_seed(0)
        return NoFormula()

    count = FirstBatchCount(factory)
    count.see((torch.zeros(2, 32, dtype=torch.long), None))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert count.count() is not None
    assert torch.equal(torch.get_rng_state(), state)
