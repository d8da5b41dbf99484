"""The causal_lm recipe's sample after training runs on rank 0 alone, from a plain one-process
copy of the trained model: under cp=2 (whose trained attention gathers keys and values from the
other rank) it used to die with gloo's "Connection closed by peer" after training and saving."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from meshtrain.checkpoint.safe_load import read_model_state
from meshtrain.models.from_config import model_factory
from meshtrain.recipes import causal_lm, resolve_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_cp_2_samples_from_the_trained_weights(example_corpus, tmp_path):
    args = ["examples/llama_tiny.toml", f"--data.path={example_corpus}",
            f"--logging.root_dir={tmp_path}", "--model.hidden_size=32", "--model.num_layers=2",
            "--model.vocab_multiple=8", "--data.seq_len=16", "--trainer.layout=cp=2",
            "--trainer.devices=2", "--trainer.global_batch_size=2", "--trainer.max_steps=2",
            "--trainer.val_every_n_steps=2", "--trainer.limit_val_batches=1",
            "--checkpoint.checkpoint_every_n_steps=none", "--checkpoint.keep_last_k=none",
            "--checkpoint.resume=none",
            "--logging.report=false", "--logging.loggers=[]", "--sample.num_tokens=6"]
    done = subprocess.run([sys.executable, "-m", "meshtrain", "train", *args], cwd=ROOT,
                          text=True, capture_output=True, timeout=220,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"--- sample -+\n(.*)\n-{20,}", done.stdout, re.S)
    assert found, done.stdout[-2000:]
    # the same sample from the final checkpoint's weights in a model built here, in one process
    config = resolve_config(args[0], args[1:])[1]
    run = next((tmp_path / "llama_tiny").iterdir())
    model = model_factory(config, causal_lm.job_model_config(config), seed=0)()
    model.load_state_dict(read_model_state(run / "checkpoints" / "final"))
    again = causal_lm.sample(model, run / "tokenizer.json", config["sample"],
                             types.SimpleNamespace(device=torch.device("cpu"), seed=0),
                             config["data"]["seq_len"])
    assert len(again) > len(config["sample"]["prompt"]) and found.group(1) == again, \
        (found.group(1), again)
