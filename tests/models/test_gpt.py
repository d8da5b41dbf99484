"""The small GPT: shapes, causality, learning, generation, init and config validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, Block, GPTConfig

torch.set_num_threads(1)


def small_config(**kw):
    args = dict(vocab_size=17, seq_len=12, num_layers=2, num_heads=4, d_model=32)
    args.update(kw)
    return GPTConfig(**args)


def random_ids(batch, seq, vocab=17, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_shape_and_pieces_compose():
    model = GPT(small_config())
    idx = random_ids(3, 10)
    logits = model(idx)
    assert logits.shape == (3, 10, 17)
    h = model.embed(idx)
    for layer in model.layers:
        assert isinstance(layer, Block)
        h = layer(h)
    assert torch.equal(model.head(model.norm(h)), logits)
    assert model.layers[0].attn.num_local_heads == 4


def test_head_is_separate_from_embedding_and_param_count():
    cfg = small_config()
    model = GPT(cfg)
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    d, v, t, hidden = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.mlp_hidden_dim
    per_block = 4 * (d * d + d) + (d * hidden + hidden) + (hidden * d + d) + 2 * 2 * d
    expected = v * d + t * d + cfg.num_layers * per_block + 2 * d + d * v
    assert model.num_params() == expected


def test_causality_later_tokens_do_not_change_earlier_logits():
    model = GPT(small_config())
    idx = random_ids(2, 12)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 17
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_init_is_deterministic_and_follows_scheme():
    cfg = small_config(num_layers=8, d_model=64)
    a, b, c = GPT(cfg, seed=1), GPT(cfg, seed=1), GPT(cfg, seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    assert a.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert a.layers[0].attn.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert a.layers[3].mlp.fc_out.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert torch.count_nonzero(a.layers[0].mlp.fc_in.bias) == 0
    assert torch.equal(a.norm.weight, torch.ones(64))


def test_training_steps_lower_the_loss():
    model = GPT(small_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = random_ids(4, 13)
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(17), rel=0.1)
    assert losses[-1] < 0.7 * losses[0]


def test_generate_length_and_determinism_with_seeded_generator():
    model = GPT(small_config(dropout=0.1))
    model.train()
    prompt = random_ids(2, 5)

    def sample(seed, **kw):
        return model.generate(prompt, 20, generator=torch.Generator().manual_seed(seed), **kw)

    out = sample(0)
    assert out.shape == (2, 25)  # longer than seq_len=12: context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, sample(0))
    assert not torch.equal(out, sample(1))
    assert model.training  # mode restored
    greedy = model.generate(prompt, 4, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 4, temperature=0.0))
    top1 = sample(3, top_k=1)[:, :9]
    assert torch.equal(top1, greedy)
    assert model.generate(prompt, 0).shape == (2, 5)


def test_forward_rejects_too_long_or_unbatched_input():
    model = GPT(small_config())
    with pytest.raises(ConfigError, match="13 tokens.*seq_len is 12.*crop"):
        model(random_ids(1, 13))
    with pytest.raises(ConfigError, match="unsqueeze"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ConfigError, match="top_k"):
        model.generate(random_ids(1, 3), 2, top_k=0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(d_model=30), r"d_model=30 is not divisible by num_heads=4.*d_model=28"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(vocab_size=1.5), "vocab_size"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(mlp_ratio=0), "mlp_ratio"),
    ],
)
def test_bad_configs_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        small_config(**kwargs)
