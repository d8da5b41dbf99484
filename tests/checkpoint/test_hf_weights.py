"""Hugging Face weights in and out of meshtrain: a save_pretrained folder loads into plain and
parallelised models (each rank reads only its slice), and a training checkpoint exports as a
folder that transformers' from_pretrained loads with the same logits."""

from datetime import timedelta

import pytest
import torch
import transformers
from safetensors.torch import load_file

from meshtrain.checkpoint.hf_export import export_hf
from meshtrain.checkpoint.hf_weights import load_hf_weights
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import DistEnv, init_process_group, run_workers
from meshtrain.models.hf import random_token_data, tiny_llama

torch.set_num_threads(1)

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])


def _folder_tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_same(got: dict, reference: dict):
    assert sorted(got) == sorted(reference)
    for name, expected in reference.items():
        assert torch.equal(got[name], expected), name


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_load_into_a_plain_model(tmp_path, shard_size):
    source = tiny_llama(seed=0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    source.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard_size)
    model = tiny_llama(seed=1)
    assert not torch.equal(model.lm_head.weight, source.lm_head.weight)
    report = load_hf_weights(model, tmp_path)
    _assert_same(model.state_dict(), source.state_dict())
    assert report["tensors"] == len(source.state_dict()) == 21
    assert report["bytes_read"] == report["bytes_total"] == 4 * sum(
        p.numel() for p in source.parameters())
    assert len(report["files"]) == (6 if shard_size else 1)


def test_tied_embeddings_and_dtype(tmp_path):
    source = tiny_llama(seed=0, tie_word_embeddings=True).to(torch.bfloat16)
    source.save_pretrained(tmp_path)
    assert "lm_head.weight" not in _folder_tensors(tmp_path)
    expected = {k: v.float() for k, v in source.state_dict().items()}
    tied = tiny_llama(seed=1, tie_word_embeddings=True)
    assert load_hf_weights(tied, tmp_path)["tensors"] == 20  # lm_head is embed_tokens
    _assert_same(tied.state_dict(), expected)
    assert tied.model.embed_tokens.weight.dtype == torch.float32
    untied = tiny_llama(seed=1)  # the folder's config ties: lm_head read from the embedding
    load_hf_weights(untied, tmp_path)
    _assert_same(untied.state_dict(), expected)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_weights(tiny_llama(), tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_hf_weights(tiny_llama(), tmp_path)
    wide, one_layer, two_layers = (tmp_path / n for n in ("wide", "one", "two"))
    tiny_llama(hidden_size=64).save_pretrained(wide)
    tiny_llama(num_layers=1).save_pretrained(one_layer)
    tiny_llama().save_pretrained(two_layers)
    model = tiny_llama(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight: .* holds shape \(32, 64\)"
                                          r".*model \(32, 32\).*hidden_size=64 \(model: 32\)"):
        load_hf_weights(model, wide)
    _assert_same(model.state_dict(), before)  # nothing copied
    with pytest.raises(ConfigError, match=r"9 tensors of LlamaForCausalLM are not in .*"
                                          r"model.layers.1.input_layernorm.weight.*"
                                          r"num_hidden_layers=1 \(model: 2\)"):
        load_hf_weights(model, one_layer)
    small = tiny_llama(num_layers=1, seed=1)
    with pytest.raises(ConfigError, match=r"9 tensors of .*two are not in LlamaForCausalLM: "
                                          r"model.layers.1.*partial=True"):
        load_hf_weights(small, two_layers)
    load_hf_weights(small, two_layers, partial=True)  # a pipeline stage: its own names only
    assert torch.equal(small.lm_head.weight, tiny_llama().lm_head.weight)


def test_pipeline_stages_load_their_own_layers(tmp_path):
    from meshtrain.models.hf.pipeline import HFPipeline

    source = tiny_llama(num_layers=3)
    source.save_pretrained(tmp_path)
    expected = source.state_dict()
    model = tiny_llama(num_layers=3, seed=1)
    stages = [HFPipeline(model).split(model, [1, 2], i) for i in range(3)]
    with pytest.raises(ConfigError, match="partial=True"):
        load_hf_weights(stages[1], tmp_path)
    loaded = {}
    for stage in stages:
        load_hf_weights(stage, tmp_path, partial=True)
        loaded.update(stage.state_dict())
    assert "model.layers.1.mlp.up_proj.weight" in stages[1].state_dict()  # full-model names
    _assert_same(loaded, expected)


# ---------------------------------------------------------------------------------------------
# Parallel layouts: each rank reads its slice
# ---------------------------------------------------------------------------------------------
def _load_parallel(layout_spec, folder, sizes):
    from meshtrain.models.hf import hf_tp_plans
    from meshtrain.parallel.apply import ParallelOptions, parallelize
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    env = DistEnv.from_environ()
    init_process_group(env, "gloo", timedelta(seconds=60))
    layout = Layout.parse(layout_spec, env.world_size)
    model = tiny_llama(seed=1, **sizes)
    options = ParallelOptions(tp_plan=hf_tp_plans(layout.degree("tp"), False, False))
    parallelize(model, ParallelMesh(layout, "cpu"), device=torch.device("cpu"), options=options)
    report = load_hf_weights(model, folder)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    placements = {k: str(getattr(v, "placements", None)) for k, v in model.state_dict().items()}
    return {"report": report, "full": full, "logits": logits, "placements": placements}


# zero3: sizes not divisible by 2 (FSDP2 pads: rank 0 holds 17 rows of 33, rank 1 16);
# 2-D: FSDP2 over tensor parallel (_StridedShard(0) x Shard(0); 19 rows per tp rank -> 10 + 9)
ODD = {"vocab_size": 33, "intermediate_size": 37, "hidden_size": 36, "num_heads": 2}
EVEN = {"vocab_size": 34, "intermediate_size": 38, "hidden_size": 36, "num_heads": 2}
CASES = {"zero3=2": (2, ODD, 0.55), "tp=2": (2, EVEN, 0.55), "dp_shard=2,tp=2": (4, EVEN, 0.3)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(CASES))
def test_load_into_parallel_layouts(tmp_path, layout):
    world, sizes, most = CASES[layout]
    source = tiny_llama(seed=0, **sizes)
    source.save_pretrained(tmp_path, max_shard_size="40KB")
    results = run_workers(_load_parallel, world, (layout, tmp_path, sizes), timeout=100)
    with torch.no_grad():
        expected_logits = source(input_ids=IDS).logits
    assert "Shard" in results[0]["placements"]["model.layers.0.mlp.up_proj.weight"]
    for rank, result in enumerate(results):
        _assert_same(result["full"], source.state_dict())
        torch.testing.assert_close(result["logits"], expected_logits, atol=1e-5, rtol=0,
                                   msg=f"rank {rank}")
        report = result["report"]
        assert report["tensors"] == 21
        # each rank reads its slice only: about 1/world of the bytes (norms replicated under tp)
        assert 0 < report["bytes_read"] < most * report["bytes_total"], (rank, report)
    assert sum(r["report"]["bytes_read"] for r in results) < 1.05 * results[0]["report"][
        "bytes_total"] * (2 if layout == "dp_shard=2,tp=2" else 1)


# ---------------------------------------------------------------------------------------------
# Export: a training checkpoint as a Hugging Face folder
# ---------------------------------------------------------------------------------------------
def _hf_logits(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        return model, model(input_ids=IDS).logits


def test_export_a_trained_checkpoint(tmp_path, capsys):
    from parity import adamw_gpt

    from meshtrain import Trainer
    from meshtrain.checkpoint.export import export

    trainer = Trainer(max_steps=2, global_batch_size=8, micro_batch_size=4, loggers=(),
                      progress_bar=False, run_dir=tmp_path / "run", seed=0)
    trained = trainer.fit(tiny_llama, random_token_data(), optimizer=adamw_gpt)
    final = trainer.run_dir / "checkpoints" / "final"
    assert not torch.equal(trained.lm_head.weight, tiny_llama().lm_head.weight)
    with torch.no_grad():
        expected = trained(input_ids=IDS).logits

    out = export_hf(final, tmp_path / "hf", config=trained.config, max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file()
    model, logits = _hf_logits(out)
    assert (logits - expected).abs().max() <= 1e-5
    generated = model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False,
                               pad_token_id=0)
    assert generated.shape == (1, 7)

    # the CLI: the config saved with the run (hf_config/ next to checkpoints/), else --config
    with pytest.raises(ConfigError, match="pass --config"):
        export([str(final), "--hf", str(tmp_path / "cli")])
    trained.config.save_pretrained(trainer.run_dir / "hf_config")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert export([str(final), "--hf", str(tmp_path / "cli"), "--tokenizer",
                   str(tmp_path / "tok"), "--dtype", "bfloat16"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "cli" / "tokenizer.json").is_file()
    exported = _folder_tensors(tmp_path / "cli")
    assert exported["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(exported["lm_head.weight"], trained.lm_head.weight.bfloat16())
    assert transformers.AutoConfig.from_pretrained(tmp_path / "cli").dtype == torch.bfloat16

    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight: the checkpoint holds "
                                          r"shape \(32, 32\), the config's model \(32, 64\)"):
        export_hf(final, tmp_path / "bad", config=tiny_llama(hidden_size=64).config)


def test_round_trip_folder_to_checkpoint_to_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint.state import _quiet_single_process, checkpoint_state

    for tie in (False, True):
        original = tmp_path / f"original{tie}"
        tiny_llama(seed=3, tie_word_embeddings=tie).save_pretrained(original)
        model = tiny_llama(seed=1, tie_word_embeddings=tie)
        load_hf_weights(model, original)
        with _quiet_single_process():  # what the Trainer saves (model entries; no optimizer)
            dcp.save(checkpoint_state(model, None), checkpoint_id=tmp_path / f"ckpt{tie}")
        out = export_hf(tmp_path / f"ckpt{tie}", tmp_path / f"out{tie}", config=original)
        first, second = _folder_tensors(original), _folder_tensors(out)
        assert sorted(first) == sorted(second)
        assert ("lm_head.weight" in second) != tie  # tied: no duplicate
        assert all(torch.equal(first[k], second[k]) for k in first)
        _hf_logits(out)
    with pytest.raises(ConfigError, match="ties lm_head.weight to model.embed_tokens.weight"):
        export_hf(tmp_path / "ckptFalse", tmp_path / "x", config=tmp_path / "originalTrue")


def _train_from(folder, root_dir, layout):
    """init_from under ``layout``, one step at learning rate 0: the final checkpoint holds the
    folder's weights, whatever the layout did with them."""
    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(layout=layout, max_steps=1, global_batch_size=4, init_from=str(folder),
                      root_dir=str(root_dir), name="from_hf", loggers=(), progress_bar=False,
                      resume=None, seed=0)
    trainer.fit(lambda: tiny_llama(seed=7), random_token_data(),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    return str(trainer.run_dir)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["zero3=2", "tp=2"])
def test_trainer_init_from_round_trip(tmp_path, layout):
    """HF folder -> Trainer(init_from=...) under a sharded layout -> checkpoint -> export_hf:
    the same tensors as the folder (and not the model's own, differently seeded init)."""
    tiny_llama(seed=3).save_pretrained(tmp_path / "hf")
    run_dir = run_workers(_train_from, 2, (tmp_path / "hf", tmp_path / "runs", layout),
                          timeout=180)[0]
    out = export_hf(f"{run_dir}/checkpoints/final", tmp_path / "out", config=tmp_path / "hf")
    _assert_same(_folder_tensors(out), _folder_tensors(tmp_path / "hf"))
    own = {k: v for k, v in tiny_llama(seed=7).state_dict().items()}
    assert any(not torch.equal(own[k], v) for k, v in _folder_tensors(tmp_path / "hf").items())
