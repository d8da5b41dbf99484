"""The causal_lm recipe: prepared token shards -> a Hugging Face Llama (or meshtrain's GPT)
trained from a config; every bad input is a clear error before any process starts."""

import re
import shutil

import pytest
import torch

from meshtrain import cli
from meshtrain.data.prepare import prepare
from meshtrain.recipes import causal_lm, resolve_config

pytestmark = pytest.mark.timeout(300)

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20 for i in range(24)]
TINY = ["--model.hidden_size=32", "--model.num_layers=2", "--model.num_heads=2",
        "--model.num_kv_heads=1", "--data.seq_len=32", "--trainer.global_batch_size=4",
        "--trainer.layout=none", "--trainer.devices=1", "--trainer.max_steps=3",
        "--trainer.val_every_n_steps=3", "--trainer.limit_val_batches=2",
        "--checkpoint.checkpoint_every_n_steps=none", "--checkpoint.keep_last_k=none",
        "--checkpoint.resume=none",
        "--model.vocab_multiple=8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXTS):
        (root / f"doc{i:02d}.py").write_text(text)
    out = tmp_path_factory.mktemp("prepared")
    prepare([root], out, train_tokenizer_vocab=300, val_fraction=0.2, overwrite=True,
            log=lambda *a: None)
    return out


def train(corpus, tmp_path, *extra, dry_run=False):
    args = ["train", "examples/llama_tiny.toml", f"--data.path={corpus}",
            f"--logging.root_dir={tmp_path}", *TINY, *extra]
    return cli.main(args + (["--dry-run"] if dry_run else []))


def test_llama_trains_and_samples(corpus, tmp_path, capsys):
    """It learns: 40 steps bring the validation perplexity below the unigram baseline (a
    model that learned only the tokens' frequencies); 3 steps are far above it."""
    assert train(corpus, tmp_path, "--trainer.max_steps=40", "--trainer.val_every_n_steps=40",
                 "--optimizer.warmup_steps=10") == 0
    out = capsys.readouterr().out
    found = re.search(r"validation perplexity ([\d.]+) .*unigram baseline ([\d.]+)", out)
    assert found and "--- sample" in out, out
    perplexity, baseline = map(float, found.groups())
    assert perplexity < 0.9 * baseline, out
    run = next((tmp_path / "llama_tiny").iterdir())
    assert (run / "hf_config" / "config.json").is_file() and (run / "tokenizer.json").is_file()
    assert (run / "checkpoints" / "final").is_dir()
    # the names the recipe says it logs (a sweep's check before any trial) are what it logged
    config = resolve_config("examples/llama_tiny.toml", [f"--data.path={corpus}", *TINY])[1]
    header = (run / "metrics.csv").open().readline().strip().split(",")[1:]
    assert set(header) == set(causal_lm.metrics(config)), header


def test_gpt_architecture_trains(corpus, tmp_path):
    assert train(corpus, tmp_path, "--model.architecture=gpt") == 0


def test_document_mask_trains_on_documents_kept_apart(corpus, tmp_path, monkeypatch):
    """[data] document_mask: the batches carry position ids restarting at each document and
    no target across one (meshtrain.packing; tests/test_packing.py shows the attention)."""
    from meshtrain.data import tokens

    seen = []
    getitem = tokens.PackedTokens.__getitem__
    monkeypatch.setattr(tokens.PackedTokens, "__getitem__",
                        lambda self, i: seen.append(getitem(self, i)) or seen[-1])
    assert train(corpus, tmp_path, "--data.document_mask=true") == 0
    assert seen and all("position_ids" in s for s in seen)
    restarts = sum(int((s["position_ids"][1:] == 0).sum()) for s in seen)
    cut = sum(int((s["labels"] == -100).sum()) for s in seen)
    assert restarts > 0 and cut >= restarts


def test_document_mask_with_the_gpt_architecture(corpus, tmp_path, monkeypatch):
    """[data] document_mask with meshtrain's GPT: (input, target) pairs with each eos's target
    cut, and the model keeps the documents apart at the shards' eos id."""
    from meshtrain.data import tokens
    from meshtrain.models import gpt

    seen, built = [], []
    getitem = tokens.PackedTokens.__getitem__
    monkeypatch.setattr(tokens.PackedTokens, "__getitem__",
                        lambda self, i: seen.append(getitem(self, i)) or seen[-1])
    init = gpt.GPT.__init__
    monkeypatch.setattr(gpt.GPT, "__init__",
                        lambda self, config, **kw: built.append(config) or init(self, config, **kw))
    assert train(corpus, tmp_path, "--model.architecture=gpt", "--data.document_mask=true") == 0
    eos = tokens.read_meta(corpus / "train")["eos_id"]
    assert built and all(c.document_eos == eos for c in built)
    assert seen and all(isinstance(s, tuple) for s in seen)
    cut = [bool(((x == eos) == (y == -100)).all()) for x, y in seen]
    assert all(cut) and sum(int((x == eos).sum()) for x, _ in seen) > 0


def test_a_moe_gpt_trains_under_expert_parallel(corpus, tmp_path):
    """[model] num_experts makes the gpt architecture meshtrain's MoE GPT (the char_lm
    recipe's fields): it trains under ep=2 and logs its router loss and expert load."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["train", "examples/llama_tiny.toml", f"--data.path={corpus}",
            f"--logging.root_dir={tmp_path}", *TINY, "--model.architecture=gpt",
            "--model.num_experts=4", "--model.router_bias_rate=0.01", "--trainer.layout=ep=2",
            "--trainer.devices=2"]  # (its other process runs the command again: a subprocess)
    out = subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=root, text=True,
                         capture_output=True, timeout=200,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp_path / "llama_tiny").iterdir())
    header = (run / "metrics.csv").open().readline().strip().split(",")
    assert "train/router_aux_loss" in header and "moe/layer1/tokens_max" in header, header
    # the names the recipe says it logs (a sweep's objective is checked against them)
    config = resolve_config("examples/llama_tiny.toml", args[2:])[1]
    assert set(header[1:]) == set(causal_lm.metrics(config)), header


@pytest.mark.parametrize("extra, message", [
    (["--data.path={missing}"], "holds no prepared token shards"),
    (["--data.tokenizer={missing}/tokenizer.json"], "does not exist"),
    (["--data.tokenizer={other}"], "is not the one the shards were written with"),
    (["--model.vocab_size=64"], "smaller than the token shards' vocab_size"),
    (["--data.seq_len=64", "--model.max_position_embeddings=48"], "above the model's maximum"),
    (["--model.architecture=bert"], "is not one of llama, qwen2, mistral, gpt"),
    (["--model.num_experts=4"], r"makes meshtrain's own GPT a mixture of experts, not a llama"),
])
def test_bad_inputs_are_clear_errors_before_any_process(corpus, tmp_path, capsys, extra, message):
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("some other text entirely " * 50)
    prepare([other], tmp_path / "other_out", train_tokenizer_vocab=280, log=lambda *a: None)
    shutil.copy(tmp_path / "other_out" / "tokenizer.json", tmp_path / "other.json")
    extra = [e.format(missing=tmp_path / "nowhere", other=tmp_path / "other.json") for e in extra]
    assert train(corpus, tmp_path, *extra, dry_run=True) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("example, extra", [
    ("llama_tiny", []), ("llama_1b_zero3", []), ("llama_1b_tp", []), ("llama_1b_pp", []),
    ("llama_1b_3d", ["--trainer.devices=32"]),
])
def test_example_configs_pass_a_dry_run(example_corpus, example, extra, capsys):
    # (the dry run checks the data too: one global batch of 256 x 2048 tokens)
    code = cli.main(["train", f"examples/{example}.toml", "--dry-run",
                     f"--data.path={example_corpus}", *extra])
    assert code == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out


def test_finetune_starts_from_the_pretrained_folder(corpus, tmp_path, capsys):
    """examples/llama_finetune.toml with a pretrained folder: one step at learning rate 0 ends
    with exactly the folder's weights; a missing folder is refused before any process."""
    from safetensors.torch import load_file

    from meshtrain.checkpoint.hf_export import export_hf
    from meshtrain.models.hf import tiny_llama

    tiny_llama(vocab_size=320, hidden_size=32, num_layers=2, seed=5).save_pretrained(
        tmp_path / "hf")
    common = ["train", "examples/llama_finetune.toml", f"--data.path={corpus}",
              f"--data.tokenizer={corpus}/tokenizer.json", f"--logging.root_dir={tmp_path}",
              "--trainer.layout=none", "--trainer.devices=1", "--data.seq_len=16",
              "--trainer.global_batch_size=4", "--trainer.val_every_n_steps=none",
              "--checkpoint.resume=none"]
    assert cli.main([*common, "--model.pretrained=nowhere", "--dry-run"]) == 2
    assert "folder nowhere does not exist" in capsys.readouterr().err
    assert cli.main([*common, f"--model.pretrained={tmp_path / 'hf'}", "--trainer.max_steps=1",
                     "--optimizer.lr=0.0", "--optimizer.warmup_steps=1"]) == 0
    run = next((tmp_path / "llama_finetune").iterdir())
    out = export_hf(run / "checkpoints" / "final", tmp_path / "out", config=tmp_path / "hf")
    got = load_file(out / "model.safetensors")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("field", ["pad_token_id", "bos_token_id", "eos_token_id"])
def test_a_token_id_outside_the_vocabulary_is_refused_by_the_dry_run(corpus, tmp_path, capsys,
                                                                     field):
    """transformers fails on such an id inside the model (pad: the embedding's padding_idx);
    the dry run names the field, its value and the vocabulary instead."""
    from meshtrain.models.hf import _transformers

    config = _transformers().LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=64,
                                         **{field: 320})
    config.save_pretrained(tmp_path / "hf")
    assert train(corpus, tmp_path, f"--model.hf_config={tmp_path / 'hf'}", dry_run=True) == 2
    err = capsys.readouterr().err
    assert f"{field}=320 in {tmp_path / 'hf'} is not a token id of the model's vocabulary " \
           "(vocab_size=320: ids 0 to 319)" in err, err
    config = config.__class__(**{**config.to_dict(), field: 7})  # an id of the vocabulary
    config.save_pretrained(tmp_path / "hf")
    assert train(corpus, tmp_path, f"--model.hf_config={tmp_path / 'hf'}", dry_run=True) == 0


@pytest.mark.parametrize("family", ["qwen3_moe aux loss", "deepseek_v3 bias"])
def test_a_hugging_face_moe_model_logs_the_routing_names_the_recipe_lists(corpus, tmp_path,
                                                                           family):
    """A Hugging Face MoE model from model.hf_config: its router loss (output_router_logits)
    or its routers' bias balancing (router_bias_rate), and its expert load, are logged under
    the names ``metrics(config)`` gives, so a sweep may take one as its objective."""
    from meshtrain.models.hf import _transformers

    t = _transformers()
    sizes = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, moe_intermediate_size=16)
    if family.startswith("qwen3_moe"):
        config = t.Qwen3MoeConfig(**sizes, intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, output_router_logits=True,
                                  router_aux_loss_coef=0.01)
    else:
        config = t.DeepseekV3Config(**{**sizes, "num_key_value_heads": 2},
                                    intermediate_size=32, n_routed_experts=4,
                                    num_experts_per_tok=2, n_group=1, topk_group=1,
                                    first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                    experts_implementation="eager")
        config.router_bias_rate = 0.01
    config.save_pretrained(tmp_path / "hf")
    extra = [f"--model.hf_config={tmp_path / 'hf'}"]
    assert train(corpus, tmp_path, *extra) == 0
    run = next((tmp_path / "llama_tiny").iterdir())
    header = (run / "metrics.csv").open().readline().strip().split(",")[1:]
    config = resolve_config("examples/llama_tiny.toml", [f"--data.path={corpus}", *TINY,
                                                         *extra])[1]
    names = causal_lm.metrics(config)
    routing = {n for n in names if n.startswith(("moe/", "train/router"))}
    if family.endswith("aux loss"):  # and both layers' expert load
        assert routing == {"train/router_aux_loss", "moe/imbalance"} | {
            f"moe/layer{i}/{s}" for i in (0, 1)
            for s in ("tokens_min", "tokens_mean", "tokens_max", "imbalance")}
    else:  # the one MoE layer (the first is dense) counted
        assert "moe/layer0/imbalance" in routing and "moe/layer1/imbalance" not in routing
    assert set(header) == set(names), header
