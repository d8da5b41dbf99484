"""Context parallel inside pipeline stages (``pp=2,cp=2``): each rank's pipeline carries its
chunks of every sequence (the batch is cut before the schedule splits it into micro-batches),
each stage switches its own attention and positions (the model's ``enable_context_parallel``),
side inputs (packed documents) and a global-mean loss's items come from the whole window.
Training, validation, prediction and a research module's logged values equal one process in
float64; a model whose attention meshtrain reaches from outside is refused before start."""

import pytest
import torch
from conftest import state_of, trainer_kwargs
from parity import GPT4_FNS, adamw_gpt, assert_parity, lm_loss, token_data

import meshtrain
from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig

torch.set_num_threads(1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, ranks, options", [
    ("pp=2,cp=2", 4, {}),
    ("pp=2,cp=2", 4, {"pp_schedule": "interleaved-1f1b", "stages_per_rank": 2}),
    ("pp=2,dp_shard=2,cp=2", 8, {}),
], ids=["1f1b", "interleaved", "dp_shard"])
def test_the_gpt_under_pp_and_cp_matches_one_process(layout, ranks, options):
    assert_parity(layout, ranks, steps=5, global_batch_size=8, fns=dict(GPT4_FNS),
                  parallel_kwargs=options)


@pytest.mark.timeout(300)
def test_packed_documents_under_pp_and_cp_match_one_process():
    """Documents cross the cp cut and the micro-batches: every stage's blocks get the whole
    window's document ids of their micro-batch; the global-mean loss counts the window's
    tokens once (counted on the cut chunks, the gradients were twice one process's)."""
    from test_packing_gpt import FNS

    assert_parity("pp=2,cp=2", 4, steps=6, global_batch_size=8, fns=dict(FNS),
                  micro_batch_size=2)


class GPTModule(GPT, meshtrain.TrainingModule):
    """meshtrain's GPT as a research module: its steps around the pipeline's stages."""

    def __init__(self):
        GPT.__init__(self, GPTConfig(vocab_size=16, seq_len=8, num_layers=4, num_heads=2,
                                     d_model=16, bias=False))

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self(batch[0]), batch[1])
        self.log("step_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        return lm_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return adamw_gpt(self.parameters())


class StepTokens(meshtrain.Callback):
    """The tokens each training step reports (what tokens/s and MFU are computed from)."""

    def setup(self, trainer):
        self.tokens, engine = [], trainer.engine
        step = engine.forward_backward

        def counted(batches):
            loss, tokens = step(batches)
            self.tokens.append(int(tokens))
            return loss, tokens
        engine.forward_backward = counted


def _fit(layout, run_dir, module):
    torch.set_num_threads(1)
    tokens = StepTokens()
    trainer = Trainer(**trainer_kwargs(run_dir, layout=layout, max_steps=4, global_batch_size=8,
                                       val_every_n_steps=2, log_every_n_steps=1,
                                       callbacks=[tokens]))
    val = torch.utils.data.Subset(token_data(5), range(8))
    if module:
        trainer.fit(lambda: GPTModule().double(), token_data(), val)
    else:
        trainer.fit(lambda: GPT4_FNS["model_fn"]().double(), token_data(), val,
                    optimizer=adamw_gpt, loss_fn=lm_loss)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
               if k in ("train/loss", "val/loss", "step_loss")}
    predicted = trainer.predict(torch.utils.data.TensorDataset(token_data(7)[:6][0]))
    metrics["validate"] = trainer.validate()["val/loss"]
    metrics["tokens"] = tokens.tokens  # every rank: its step's tokens, as one process counts
    state = {k: v.detach().clone() for k, v in trainer.whole_model().state_dict().items()}
    return state, metrics, torch.stack(predicted) if isinstance(predicted, list) else predicted


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", [False, True], ids=["model", "research module"])
def test_validation_prediction_and_logged_values_match_one_process(tmp_path, module):
    want, want_metrics, want_out = _fit(None, tmp_path / "one", module)
    ranks = run_workers(_fit, 4, ("pp=2,cp=2", tmp_path / "pp_cp", module))
    assert [r[1]["tokens"] for r in ranks] == [[8 * 8] * 4] * 4  # first and last stages alike
    state, metrics, out = ranks[0]
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-12, msg=name)
    assert metrics.keys() == want_metrics.keys() and len(metrics) == 4 + module
    assert metrics.pop("tokens") == want_metrics.pop("tokens") == [8 * 8] * 4
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12), name
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)  # whole sequences


def test_a_model_reached_from_outside_is_refused_before_start(tmp_path, no_processes):
    from meshtrain.models.hf import tiny_llama

    trainer = Trainer(**trainer_kwargs(tmp_path, layout="pp=2,cp=2", devices=4, max_steps=1,
                                       global_batch_size=8))
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    with pytest.raises(ConfigError, match="cp with pp needs a model that implements "
                                          "enable_context_parallel itself.*Hugging Face adapter"):
        trainer.fit(tiny_llama, data, optimizer=adamw_gpt)
