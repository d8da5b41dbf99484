"""What a first-time user met, each said with what to do (issue 78): checked before any process
starts, through the API a user calls (Trainer.check, the CLI's main in this process)."""

import pytest
import torch
from conftest import trainer_kwargs

from meshtrain import ConfigError, Trainer, TrainingModule

torch.set_num_threads(1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.mark.timeout(120)
def test_tp_on_a_hugging_face_moe_model_says_experts_are_split_by_ep(tmp_path):
    """Not a tp_plan key the user never wrote: the reason (experts are not split by tp) and
    the layouts that work."""
    from meshtrain.models.hf import random_token_data, tiny_causal_lm

    moe = tiny_causal_lm("Qwen3Moe", vocab_size=32, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=16, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, experts_implementation="eager")
    trainer = Trainer(**trainer_kwargs(tmp_path, layout="tp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError) as error:
        trainer.check(moe, random_token_data(), optimizer=_adamw)
    message = str(error.value)
    assert "tp_plan key" not in message
    assert "mixture-of-experts model (4 experts in each of 2 MoE layers)" in message
    assert "does not split a Hugging Face model's experts by tensor parallel" in message
    assert 'layout="ep=2"' in message and '"dp_shard=2,ep=2"' in message


def _fit_one_step(run_dir, model_fn, data, **fit):
    trainer = Trainer(**trainer_kwargs(run_dir, max_steps=1, global_batch_size=4,
                                       save_final_checkpoint=True))
    return trainer.fit(model_fn, data, optimizer=_adamw, **fit)


@pytest.mark.timeout(120)
def test_export_takes_a_run_folder_and_says_which_folder_to_give(tmp_path, capsys):
    from meshtrain import cli
    from meshtrain.models.hf import random_token_data, tiny_llama

    run = tmp_path / "runs" / "job" / "20260101-000000"
    trained = _fit_one_step(run, tiny_llama, random_token_data(num_samples=8))
    trained.config.save_pretrained(run / "hf_config")  # (what the causal_lm recipe saves)
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    assert f"exporting {run / 'checkpoints' / 'final'}" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # the job's folder (one run folder per start): the message names the run folder to give
    assert cli.main(["export", str(run.parent), "--hf", str(tmp_path / "x")]) == 2
    assert f"give one of them, e.g. the newest: {run}" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "nothing"), "model.pt"]) == 2
    assert "give a run folder (runs/<name>/<time>)" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_export_hf_of_meshtrains_gpt_says_it_has_no_hugging_face_architecture(tmp_path, capsys):
    from meshtrain import cli
    from meshtrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=32, seq_len=16, num_layers=1, num_heads=2, d_model=16)
    data = [(torch.randint(0, 32, (16,)), torch.randint(0, 32, (16,))) for _ in range(8)]
    trained = _fit_one_step(tmp_path / "run", lambda: GPT(config), data, loss_fn=lambda out, y:
                            torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert cli.main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "meshtrain's own GPT" in err and "no Hugging Face architecture" in err
    assert "none saved with the run" not in err  # (not a config it could never have)
    # the export it names works: a state_dict file GPT loads
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "model.pt")]) == 0
    model = GPT(config)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    assert torch.equal(model.head.weight, trained.head.weight)


def test_an_unknown_layout_axis_lists_every_name_the_grammar_takes():
    from meshtrain import LayoutError
    from meshtrain.parallel.layout import Layout

    with pytest.raises(LayoutError, match="unknown layout axis 'zero'") as error:
        Layout.parse("zero=2", 2)
    message = str(error.value)
    assert message.endswith("(did you mean 'zero3'?)")
    listed = message.split("known axes: ")[1].split(" (")[0].split(", ")
    assert {"ep", "ps", "tp", "zero3"} <= set(listed)
    for name in listed:  # each one listed is one the grammar takes
        try:
            Layout.parse(f"{name}=2", 4)
        except LayoutError as refused:
            assert "unknown layout axis" not in str(refused), name


@pytest.mark.timeout(60)
def test_ep_that_does_not_divide_the_experts_offers_only_degrees_that_fit(tmp_path):
    from meshtrain.models.gpt import GPT, GPTConfig

    data = [(torch.randint(0, 32, (16,)), torch.randint(0, 32, (16,))) for _ in range(24)]

    def refusal(layout, devices, num_experts):
        config = GPTConfig(vocab_size=32, seq_len=16, num_layers=1, num_heads=2, d_model=16,
                           num_experts=num_experts, experts_per_token=1)
        trainer = Trainer(**trainer_kwargs(tmp_path, layout=layout, devices=devices,
                                           max_steps=1, global_batch_size=24))
        with pytest.raises(ConfigError, match="does not divide the") as error:
            trainer.check(lambda: GPT(config), data, optimizer=_adamw, loss_fn=lambda out, y:
                          torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
        return str(error.value)

    # 3 experts on 2 processes: no ep fits (ep=3 needs 3 data-parallel ranks)
    message = refusal("ep=2", 2, 3)
    assert "among" not in message
    assert "drop ep" in message and 'layout="ep=3" on 3 processes' in message
    # 6 experts: on 4 processes only 2 divides both (not 3 or 6); on 12 all three do
    assert "pick ep among [2] " in refusal("dp_shard=4,ep=4", 4, 6)
    assert "pick ep among [2, 3, 6] " in refusal("dp_shard=12,ep=4", 12, 6)


@pytest.mark.timeout(60)
def test_a_misspelt_monitor_is_refused_before_start_naming_the_closest(tmp_path):
    from meshtrain import EarlyStopping, ModelCheckpoint

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=gen),
                                          torch.randn(16, 2, generator=gen))

    def check(*callbacks, val_data=data, model=None, **settings):
        trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=8,
                                           callbacks=list(callbacks), **settings))
        trainer.check(model or torch.nn.Linear(4, 2), data, val_data, optimizer=_adamw,
                      loss_fn=None if model else torch.nn.functional.mse_loss)

    with pytest.raises(ConfigError, match=r"EarlyStopping monitors 'val/los', which this run's "
                                          r"validation does not log .*did you mean 'val/loss'\?"):
        check(EarlyStopping("val/los"))
    with pytest.raises(ConfigError, match=r"ModelCheckpoint monitors 'val/acc'.*'val/loss', "
                                          r"'val/token_accuracy'"):
        check(ModelCheckpoint(monitor="val/acc"), metrics=["token_accuracy"])
    check(EarlyStopping("val/loss"), ModelCheckpoint(monitor="val/token_accuracy", mode="max"),
          metrics=["token_accuracy"])  # what the run logs passes
    check(EarlyStopping("val/los", strict=False))  # (not strict: a missing value is skipped)
    check(EarlyStopping("val/los"), val_data=None)  # (no validation: nothing is monitored)
    check(EarlyStopping("val/acc"), model=_LogsItsOwn())  # (self.log: checked at validation)


class _LogsItsOwn(TrainingModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", -self.training_step(batch, batch_idx))


def test_torchtitans_config_file_flag_given_with_a_config_path_too_is_refused(capsys):
    from meshtrain import cli

    # (--job.config_file alone trains: tests/test_torchtitan_names.py dry-runs the main job so)
    assert cli.main(["train", "a.toml", "--job.config_file", "b.toml"]) == 2
    assert "the config file is given twice: a.toml and --job.config_file b.toml" in \
        capsys.readouterr().err
    assert cli.main(["train", "--dry-run", "--job.config_file"]) == 2
    assert "--job.config_file needs the config file's path" in capsys.readouterr().err


def _regression(n=16):
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=gen),
                                          torch.randn(n, 2, generator=gen))


@pytest.fixture
def torch_seed_restored():
    """torch's global seed and meshtrain's record of it as they were (later tests' Trainer()
    must not take this test's torch.manual_seed)."""
    from meshtrain.loop import seeding

    saved, state = dict(seeding._SEEDS), torch.get_rng_state()
    yield
    seeding._SEEDS.update(saved)
    torch.set_rng_state(state)


@pytest.mark.timeout(60)
def test_a_torch_manual_seed_before_the_trainer_is_its_seed(tmp_path, torch_seed_restored):
    kwargs = trainer_kwargs(tmp_path, max_steps=1, global_batch_size=8)
    del kwargs["seed"]
    torch.manual_seed(123)
    trainer = Trainer(**kwargs)
    assert trainer.seed == 123
    assert "seed: 123, from torch.manual_seed(123) before Trainer() (Trainer(seed=N) sets " \
        "another)" in trainer.loader_notes
    trainer.fit(torch.nn.Linear(4, 2), _regression(), optimizer=_adamw,
                loss_fn=torch.nn.functional.mse_loss)
    assert torch.initial_seed() != 123  # (fit reseeds torch for each rank's dropout)
    assert Trainer(**kwargs).seed == 123  # what fit left is meshtrain's, not the user's
    assert Trainer(**kwargs, seed=3).seed == 3  # seed= wins
    torch.manual_seed(7)
    assert Trainer(**kwargs).seed == 7
    torch.manual_seed(2**40)  # (not told from the 64 random bits torch seeds a process with)
    assert Trainer(**kwargs).seed == 0


def _fit_seeded_per_rank(run_dir):
    import os

    torch.set_num_threads(1)
    torch.manual_seed(10 + int(os.environ["RANK"]))  # (a seed per rank: ranks would split
    kwargs = trainer_kwargs(run_dir, max_steps=1, global_batch_size=8)  # the data wrongly)
    del kwargs["seed"]
    Trainer(**kwargs).fit(torch.nn.Linear(4, 2), _regression(), optimizer=_adamw,
                          loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.timeout(120)
def test_ranks_whose_seeds_differ_are_refused(tmp_path):
    from meshtrain.errors import WorkerFailed
    from meshtrain.launch.spawn import run_workers

    with pytest.raises(WorkerFailed, match=r"the ranks' seeds differ \(rank 0: 10, rank 1: "
                                           r"11\).*Pass the same Trainer\(seed=N\)"):
        run_workers(_fit_seeded_per_rank, 2, (str(tmp_path),), timeout=90)
