"""torchtitan's config names in a meshtrain config or override (meshtrain/settings/torchtitan.py):
``[parallelism]`` degrees are one layout (``data_parallel_shard_degree`` -1 unless given, as in
torchtitan), ``[training] steps`` is ``max_steps`` ..., each said in the resolved config; one
meshtrain does another way is refused naming that way. The main job trained from torchtitan's
names resolves to the same Trainer settings as the job written in meshtrain's."""

from pathlib import Path

import pytest

from meshtrain import cli, settings
from meshtrain.config import resolve
from meshtrain.errors import ConfigError
from meshtrain.recipes import resolve_config

CONFIG = str(Path(__file__).parents[1] / "examples" / "char_gpt.toml")
TITAN = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
         "1", "--training.steps", "7", "--training.max_norm", "0.5", "--training.seq_len", "64",
         "--activation_checkpoint.mode", "selective", "--checkpoint.interval", "3",
         "--checkpoint.keep_latest_k", "0", "--metrics.log_freq", "2",
         "--metrics.enable_tensorboard", "false", "--comm.train_timeout_seconds", "200",
         "--parallelism.pipeline_parallel_schedule", "GPipe", "--job.dump_folder", "out"]
OURS = ["--trainer.layout=tp=2,dp_shard=1", "--trainer.max_steps=7", "--trainer.grad_clip_norm=0.5",
        "--data.seq_len=64", "--parallel.activation_checkpointing=selective",
        "--checkpoint.checkpoint_every_n_steps=3", "--checkpoint.keep_last_k=none",
        "--logging.log_every_n_steps=2", '--logging.loggers=["csv"]',
        "--fault.collective_timeout_s=200", "--pipeline.pp_schedule=gpipe",
        "--logging.root_dir=out"]


def test_torchtitan_names_resolve_to_meshtrains_settings():
    _, _, titan = resolve_config(CONFIG, TITAN)
    _, _, ours = resolve_config(CONFIG, OURS)
    assert titan == {**ours, "layout": "dp_shard=1,tp=2"}
    assert settings.check(titan)["layout"] == "dp_shard=1,tp=2"
    # the degrees default as torchtitan's do: FSDP over what the others leave
    _, _, flat = resolve_config(CONFIG, ["--parallelism.context_parallel_degree=2"])
    assert flat["layout"] == "dp_shard=-1,cp=2"


def test_the_resolved_config_says_what_each_torchtitan_name_became(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)  # (the config named as torchtitan names it)
    assert cli.main(["train", "--job.config_file", CONFIG, "--dry-run", "--trainer.devices=2",
                     *TITAN[:4]]) == 0
    out = capsys.readouterr().out
    assert '# torchtitan: [parallelism]\'s degrees (-1: the processes left) is trainer.layout="dp_shard=1,tp=2"' in out
    assert "config OK" in out


@pytest.mark.parametrize("override, says", [
    ("--float8.enable_fsdp_float8_all_gather=true", 'trainer.float8 = "tensorwise"'),
    ("--checkpoint.initial_load_path=x", "checkpoint.init_from"),
    ("--parallelism.fsdp_reshard_after_forward=never", "zero2=N"),
    ("--parallelism.pipeline_parallel_schedule=Nope", "no such value of pipeline.pp_schedule"),
    ("--parallelism.some_new_degree=2", "an unknown torchtitan key"),
])
def test_what_meshtrain_does_another_way_is_refused(tmp_path, monkeypatch, capsys, override,
                                                    says):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", CONFIG, "--dry-run", override]) == 2
    assert says in capsys.readouterr().err


def test_a_torchtitan_name_and_its_meshtrain_setting_at_one_level_are_refused():
    defaults = {"trainer": {"max_steps": None, "layout": None}}
    with pytest.raises(ConfigError, match="trainer.max_steps given both as itself and by its "
                                          "torchtitan name"):
        resolve(defaults, {"trainer": {"max_steps": 5}, "training": {"steps": 7}}, [])
    # an override wins over the file, whichever names it uses
    assert resolve(defaults, {"trainer": {"max_steps": 5}}, ["--training.steps=7"])[
        "trainer"]["max_steps"] == 7
    assert resolve(defaults, {"training": {"steps": 5}}, ["--trainer.max_steps=7"])[
        "trainer"]["max_steps"] == 7
    # degrees from the file and from overrides make one layout
    notes = []
    got = resolve(defaults, {"parallelism": {"tensor_parallel_degree": 2}},
                  ["--parallelism.pipeline_parallel_degree=2"], notes=notes)
    assert got["trainer"]["layout"] == "dp_shard=-1,tp=2,pp=2"
    assert notes == ["torchtitan: [parallelism]'s degrees (-1: the processes left) is "
                     'trainer.layout="dp_shard=-1,tp=2,pp=2"']
