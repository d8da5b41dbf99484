"""The `meshtrain` command: the main job end to end (tiny), config errors, lr-find, --dry-run,
a user's recipe by import path."""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain import Trainer, cli
from meshtrain import settings
from meshtrain.config import parse_override, resolve
from meshtrain.errors import ConfigError
from meshtrain.observe.loggers import read_metrics_csv
from meshtrain.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--data.max_chars=60000", "--data.seq_len=32", "--model.num_layers=1", "--model.d_model=32",
    "--model.num_heads=2", "--trainer.global_batch_size=8", "--trainer.val_every_n_steps=4",
    "--trainer.limit_val_batches=4", "--logging.log_every_n_steps=2", "--sample.num_chars=20",
    "--model.mlp_ratio=64",
]


def meshtrain(*args, cwd, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def meshtrain_script(*args, cwd, timeout=60):
    """The installed `meshtrain` command itself (not python -m), as a user runs it."""
    script = Path(sys.executable).parent / "meshtrain"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# The fewest steps at which the TINY model reliably gets below the unigram baseline (3.18
# nats/char on these 60k characters): 40 steps end at 2.99-3.05 over seeds 0-3 (32 steps at 3.15,
# too close; 24 at 3.35). Steps are cheap; start-up dominates (40 steps take ~6 s, 8 took ~6 s).
DEMO_STEPS = 40
FINAL = re.compile(r"validation loss (\d+\.\d+) nats/char; unigram baseline (\d+\.\d+) "
                   r"nats/char \(.* parameters, (\d+) steps\)")


@pytest.mark.timeout(150)
def test_train_main_job_on_two_processes(tmp_path):
    config = ROOT / "examples" / "char_gpt.toml"
    out = meshtrain("train", str(config), *TINY, f"--trainer.max_steps={DEMO_STEPS}",
                    f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unigram baseline" in out.stdout and "--- sample" in out.stdout
    assert out.stdout.count("validation loss") == 1, "console output must come from rank 0 only"
    (run_dir,) = (tmp_path / "char_gpt").iterdir()
    for name in ("config.toml", "metrics.csv", "loss.png", "tokenizer.json", "tensorboard",
                 "checkpoints/final/.metadata"):
        assert (run_dir / name).exists(), name
    saved = (run_dir / "config.toml").read_text()
    assert f"max_steps = {DEMO_STEPS}" in saved and 'layout = "dp=2"' in saved

    # training worked: the final validation loss is below the unigram baseline (a model that
    # learned only character frequencies) and below the first validation's
    (final,) = FINAL.findall(out.stdout)
    val_loss, baseline, steps = float(final[0]), float(final[1]), int(final[2])
    assert steps == DEMO_STEPS
    assert 2.5 < baseline < 4.5  # the character entropy of source code, in nats
    assert val_loss < baseline, (val_loss, baseline)
    # metrics.csv records the same final loss, at the last step, after higher earlier ones
    val_rows = [(r["step"], r["val/loss"]) for r in read_metrics_csv(run_dir / "metrics.csv")
                if r.get("val/loss") is not None]
    assert [step for step, _ in val_rows] == list(range(4, DEMO_STEPS + 1, 4))  # every 4 steps
    assert val_rows[-1][1] == pytest.approx(val_loss, abs=5e-4)
    assert val_rows[0][1] > val_rows[-1][1] + 0.5
    train_losses = [r["train/loss"] for r in read_metrics_csv(run_dir / "metrics.csv")
                    if r.get("train/loss") is not None]
    assert len(train_losses) == DEMO_STEPS // 2 and train_losses[-1] < train_losses[0] - 0.5


@pytest.mark.timeout(120)
def test_the_closing_sample_works_under_pipeline_parallel(tmp_path):
    """The job ends with a generated sample: under pp it comes from the stages gathered into
    one model. Rank 0's first stage alone returned hidden states of width d_model, not logits:
    with d_model above the vocabulary size the sampled ids were out of range (IndexError)."""
    config = ROOT / "examples" / "char_gpt.toml"
    out = meshtrain("train", str(config), *TINY, "--trainer.max_steps=2", "--trainer.layout=pp=2",
                    "--model.num_layers=2", "--model.d_model=128", "--model.mlp_ratio=1",
                    f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    sample = out.stdout.split("--- sample")[1].splitlines()[1]
    assert sample.startswith("def ") and len(sample) > len("def "), out.stdout[-500:]


@pytest.mark.timeout(60)
def test_bad_config_key_and_missing_data_path_are_clear_errors(tmp_path, monkeypatch, capsys):
    config = str(ROOT / "examples" / "char_gpt.toml")
    out = meshtrain("train", config, "--trainer.max_stepz=3", cwd=tmp_path)
    assert out.returncode == 2
    assert "unknown key trainer.max_stepz" in out.stderr and "max_steps" in out.stderr
    assert "Traceback" not in out.stderr
    # the others by the command's main in this process (both refused before any process)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", config, "--data.path=/no/such/file.txt"]) == 2
    assert "data.path /no/such/file.txt does not exist" in capsys.readouterr().err
    assert cli.main(["train", config, "--trainer.layout=dp=3"]) == 2
    assert "world size is 2" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_lr_find_writes_a_plot_and_suggests_a_rate(tmp_path):
    config = str(ROOT / "examples" / "char_gpt.toml")
    out = meshtrain("lr-find", config, *TINY, "--trainer.devices=1", "--trainer.layout=dp=1",
                    f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # the recipe sweeps Trainer.lr_find's default range; the suggestion is one of its rates
    defaults = inspect.signature(Trainer.lr_find).parameters
    min_lr, max_lr = defaults["min_lr"].default, defaults["max_lr"].default
    (shown,) = re.findall(r"suggested learning rate (\S+); plot: ", out.stdout)
    assert min_lr <= float(shown) <= max_lr, (shown, min_lr, max_lr)
    assert list(tmp_path.glob("char_gpt/*/lr_find.png"))


def test_version_and_help():
    out = meshtrain("--version", cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("meshtrain ")
    out = meshtrain("--help", cwd=ROOT)
    assert "train" in out.stdout and "slurm" in out.stdout
    for command in ("prepare", "parity", "memory", "lr-find", "export", "run"):
        assert f"meshtrain {command} " in out.stdout, command
    assert any("export" in line and "--hf" in line for line in out.stdout.splitlines())


def test_help_lists_commands_and_every_setting_with_its_default():
    out = meshtrain("--help", cwd=ROOT)
    commands = out.stdout.split("commands:")[1].split("forms:")[0].splitlines()
    assert any(line.split()[:1] == ["sweep"] for line in commands)  # one line each
    out = meshtrain("train", "--help", cwd=ROOT)
    assert out.returncode == 0
    assert "  --trainer.max_steps  (default: none)" in out.stdout
    assert "  --checkpoint.resume  (default: \"auto\")" in out.stdout
    out = meshtrain("train", "examples/char_gpt.toml", "--trainer.max_steps", "7", "--help",
                    cwd=ROOT)  # a config's values, the space form read
    assert "  --trainer.max_steps  (value: 7)" in out.stdout, out.stdout[-2000:]
    assert "[model]" in out.stdout


def test_overrides_take_the_space_form_too(tmp_path):
    from meshtrain.config import join_overrides

    out = meshtrain("train", str(ROOT / "examples/char_gpt.toml"), *TINY,
                    "--trainer.max_steps", "5", "--trainer.devices", "1", "--trainer.layout", "none", "--logging.root_dir",
                    str(tmp_path), "--checkpoint.resume", "none", cwd=ROOT, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "max_steps = 5" in out.stdout and "fit: 5 steps" in out.stdout

    assert join_overrides(["--trainer.max_steps", "10", "--trainer.layout=dp=2",
                           "--optimizer.lr", "-1e-3"]) == [
        "--trainer.max_steps=10", "--trainer.layout=dp=2", "--optimizer.lr=-1e-3"]
    assert join_overrides(["--dry-run", "x"]) == ["--dry-run", "x"]  # not a setting


def test_overrides_are_read_as_toml_values():
    assert parse_override("--trainer.max_steps=10") == ("trainer", "max_steps", 10)
    assert parse_override("--trainer.layout=dp=2") == ("trainer", "layout", "dp=2")
    assert parse_override("--optimizer.lr=1e-3") == ("optimizer", "lr", 1e-3)
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_override("--max_steps=10")
    config = resolve({"a": {"x": 1, "y": "s"}}, {"a": {"x": 2}}, ["--a.y=t"])
    assert config == {"a": {"x": 2, "y": "t"}}
    with pytest.raises(ConfigError, match="unknown section"):
        resolve({"a": {"x": 1}}, {"b": {"x": 2}}, [])


@pytest.mark.timeout(120)
def test_memory_prints_measured_and_predicted_model_state(tmp_path):
    config = str(ROOT / "examples" / "char_gpt.toml")
    out = meshtrain("memory", config, *TINY, "--trainer.layout=zero3=2",
                    f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ZeRO stage 3 (sharded over N = 2)" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("dp_shard=2"))
    measured_total, predicted_total = (float(x) for x in row.split()[4:6])
    assert predicted_total > 0 and abs(measured_total / predicted_total - 1) < 0.05


def test_dry_run_prints_every_setting_checks_and_trains_nothing(tmp_path, monkeypatch, capsys):
    config = str(ROOT / "examples" / "char_gpt.toml")
    out = meshtrain_script("train", config, "--dry-run", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ('pp_schedule = "1f1b"', 'nan_policy = "error"', "keep_last_k = 2",
                 "sequence_parallel = false", "# activation_checkpointing = none",
                 "# offload = none", "# comm_hook = none", 'layout = "dp=2"', "max_steps = 400",
                 'name = "char_gpt"', "[pipeline]", "[checkpoint]", "[fault]", "[logging]"):
        assert line in out.stdout.splitlines(), line
    for name, setting in settings.SETTINGS.items():  # every setting, with its value
        shown = re.search(rf"^(# )?{name} = \S", out.stdout, re.MULTILINE)
        assert shown or not setting.config, name
    python_only = "Python-only Trainer settings (not in a config): callbacks, blocks, tp_plan"
    assert python_only in out.stdout
    assert "config OK" in out.stdout and "nothing was trained" in out.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    # the other recipe commands take it too, with their own overrides (their main, here)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["memory", config, "--dry-run", "--trainer.layout=zero3=2",
                     "--parallel.activation_checkpointing=full"]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and 'activation_checkpointing = "full"' in out
    assert cli.main(["lr-find", "--dry-run", config, "--trainer.devices=1",
                     "--trainer.layout=dp=1"]) == 0
    assert "config OK" in capsys.readouterr().out


@pytest.mark.parametrize("overrides,named", [
    (["--parallel.comm_hook=fp16", "--trainer.layout=zero3=2"], "comm_hook"),
    (["--parallel.bucket_cap_mb=50", "--trainer.layout=zero3=2"], "bucket_cap_mb"),
    (["--parallel.sequence_parallel=true"], "sequence_parallel"),
    (["--fault.stall_timeout_s=400"], "stall_timeout_s"),
    (["--pipeline.pp_schedule=zigzag"], "pp_schedule"),
    (["--checkpoint.keep_last_k=0"], "keep_last_k"),
    (["--trainer.resume=none"], "[checkpoint]"),  # a key in the wrong section: names the right one
    (["--trainer.callbacks=[]"], "Python-only"),
])
def test_dry_run_of_a_bad_config_exits_2_naming_the_setting(tmp_path, monkeypatch, capsys,
                                                            overrides, named):
    # in this process (the command's exit code is main's return value; that a subprocess
    # exits with it is test_bad_config_key_and_missing_data_path_are_clear_errors's)
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "examples" / "char_gpt.toml")
    assert cli.main(["train", config, "--dry-run", *overrides]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("meshtrain: error: ") and named in out.err, out.err
    assert "Traceback" not in out.err and "config OK" not in out.out


USER_RECIPE = """
from meshtrain import Trainer, settings

class Recipe:
    DEFAULTS = {
        "job": {"recipe": "my_recipe:recipe"},
        "model": {"width": 8},
        **settings.config_sections(),
    }

    def run(self, config, mode="train"):
        trainer = Trainer(**settings.flatten(config))
        print(f"user recipe {mode}: width {config['model']['width']}, "
              f"max_steps {trainer.max_steps}, nan_policy {trainer.nan_policy}")

recipe = Recipe()
"""


def test_a_recipe_named_by_import_path_runs_and_dry_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_recipe.py").write_text(USER_RECIPE)
    (tmp_path / "job.toml").write_text('[job]\nrecipe = "my_recipe:recipe"\n[model]\nwidth = 16\n'
                                       '[trainer]\nmax_steps = 3\n[fault]\nnan_policy = "none"\n')
    out = meshtrain_script("train", "job.toml", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "width = 16" in out.stdout and "max_steps = 3" in out.stdout
    assert 'nan_policy = "none"' in out.stdout and "config OK" in out.stdout
    assert "user recipe" not in out.stdout  # a dry run does not call run()
    # the rest by the command's main in this process (the recipe only builds a Trainer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["train", "job.toml", "--model.width=4"]) == 0
    out = capsys.readouterr()
    assert "user recipe train: width 4, max_steps 3, nan_policy None" in out.out
    assert cli.main(["train", "job.toml", "--dry-run", "--trainer.max_steps=0"]) == 2
    assert "max_steps must be a positive integer" in capsys.readouterr().err

    (tmp_path / "bad.toml").write_text('[job]\nrecipe = "no_such_pkg.train:recipe"\n')
    assert cli.main(["train", "bad.toml", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot import module 'no_such_pkg.train'" in err, err


def test_a_bad_recipe_import_path_says_what_failed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mt_broken_recipe.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "mt_needs_dep.py").write_text("import mt_no_such_dependency\n")
    (tmp_path / "mt_not_a_recipe.py").write_text("DEFAULTS = {}\nrecipe = object()\n")
    with pytest.raises(ConfigError, match="unknown recipe 'char_llm'.*did you mean 'char_lm'"):
        load_recipe("char_llm")
    with pytest.raises(ConfigError, match=r"importing 'mt_broken_recipe' failed: RuntimeError: "
                                          r"boom \(.*mt_broken_recipe.py:1\)"):
        load_recipe("mt_broken_recipe:recipe")
    with pytest.raises(ConfigError, match="importing 'mt_needs_dep' failed: ModuleNotFoundError"):
        load_recipe("mt_needs_dep:recipe")
    with pytest.raises(ConfigError, match="module 'mt_not_a_recipe' has no attribute 'nope'"):
        load_recipe("mt_not_a_recipe:nope")
    with pytest.raises(ConfigError, match=r"is not a recipe: it has no run\(config, mode\)"):
        load_recipe("mt_not_a_recipe")  # the module: DEFAULTS but no run
    with pytest.raises(ConfigError, match=r"is not a recipe: it has no DEFAULTS .* and no run"):
        load_recipe("mt_not_a_recipe:recipe")
    assert load_recipe("char_lm").DEFAULTS["trainer"]["layout"] == "dp=2"


def test_the_recipe_reaches_every_config_setting_with_its_own_defaults():
    from meshtrain.recipes import char_lm

    for section, values in settings.config_sections().items():
        assert set(char_lm.DEFAULTS[section]) == set(values), section
    flat = settings.flatten(char_lm.DEFAULTS)
    assert flat == {**{n: v for s in settings.config_sections().values() for n, v in s.items()},
                    "layout": "dp=2", "devices": 2, "max_steps": 400, "grad_clip_norm": 1.0,
                    "val_every_n_steps": 100, "log_every_n_steps": 10}


def test_a_config_without_a_name_names_the_job_after_its_file(tmp_path):
    """Two configs of the built-in recipe must not share one job (resume='auto' would pick
    the other's runs): the name defaults to the config file's name."""
    from meshtrain.recipes import resolve_config

    config = tmp_path / "tiny_lm.toml"
    config.write_text('[job]\nrecipe = "char_lm"\n')
    assert resolve_config(str(config), [])[2]["name"] == "tiny_lm"
    assert resolve_config(str(config), ["--logging.name=mine"])[2]["name"] == "mine"


def test_the_readme_dry_runs_pass(tmp_path, monkeypatch, capsys):
    """The README's `meshtrain train ... --dry-run` commands, as written, check OK (run by the
    command's main in this process: a dry run starts no process)."""
    readme = (ROOT / "README.md").read_text()
    commands = [line.split("#")[0].split() for line in readme.splitlines()
                if line.startswith("meshtrain train ") and "--dry-run" in line]
    assert commands, "the README shows no dry run"
    monkeypatch.chdir(tmp_path)
    for command in commands:
        args = [str(ROOT / a) if a.startswith("examples/") else a for a in command[1:]]
        code = cli.main(args)
        out = capsys.readouterr()
        assert code == 0 and "config OK" in out.out, (command, out.err[-2000:])


# ---- --dry-run makes every check train makes before any process starts (issue 26) ---------------
@pytest.mark.parametrize("config,overrides,named", [
    # char_gpt with tp=4 and 2 heads
    ("char_gpt", ["--trainer.layout=tp=4", "--trainer.devices=4", "--model.num_heads=2"],
     ["tp=4", "num_heads=2", "use a tp that divides 2"]),
    # pp=8 on 4 layers
    ("char_gpt", ["--trainer.layout=pp=8", "--trainer.devices=8"],
     ["pp=8", "only 4 blocks", "use fewer stages"]),
    # compile="model" with activation checkpointing
    ("char_gpt", ['--parallel.compile="model"', "--parallel.activation_checkpointing=full"],
     ["compile='model'", "activation_checkpointing='full'", "use compile=True"]),
    # llama_1b_tp.toml (tp=8) with 4 KV heads
    ("llama_1b_tp", ["--model.num_kv_heads=4"], ["tp=8", "num_key_value_heads=4", "use a tp"]),
    # llama_1b_pp.toml (pp=4, 2 stages per rank) with 2 layers
    ("llama_1b_pp", ["--model.num_layers=2"],
     ["pp=4 x stages_per_rank=2", "only 2 blocks", "use fewer stages"]),
    # the README's own example: a pipeline schedule on the dp=2 demo, which has no pp
    ("char_gpt", ["--pipeline.pp_schedule=gpipe"],
     ["pp_schedule='gpipe'", "has no pp axis", "add pp=N to the layout, or drop pp_schedule"]),
], ids=["tp4-2heads", "pp8-4layers", "compile-model-with-checkpointing", "llama_1b_tp-4kv",
        "llama_1b_pp-2layers", "pp_schedule-without-pp"])
def test_dry_run_refuses_what_train_refuses_naming_setting_and_fix(example_corpus, capsys, config,
                                                                   overrides, named):
    data = [f"--data.path={example_corpus}"] if config.startswith("llama") else []
    code = cli.main(["train", f"examples/{config}.toml", "--dry-run", *data, *overrides])
    out, err = capsys.readouterr()
    assert code != 0 and "config OK" not in out, (out[-500:], err[-2000:])
    assert err.startswith("meshtrain: error: ") and "Traceback" not in err, err
    for words in named:
        assert words in err, (words, err)


JOB_RECIPE = """
import torch
from torch.utils.data import TensorDataset
from meshtrain import settings

DEFAULTS = {"job": {"recipe": "job_recipe"}, **settings.config_sections()}

def run(config, mode="train"):
    raise AssertionError("a dry run does not train")

def job(config):
    x = torch.randn(64, 4)
    return dict(model=lambda: torch.nn.Linear(4, 2), train_data=TensorDataset(x, x[:, :2]),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                loss_fn=torch.nn.functional.mse_loss)
"""


def test_a_recipe_without_check_is_dry_run_on_its_job(tmp_path):
    """A user's recipe with job() but no check(): the dry run checks that job's model against
    the layout (a Linear has no tensor-parallel plan of its own)."""
    (tmp_path / "job_recipe.py").write_text(JOB_RECIPE)
    (tmp_path / "job.toml").write_text('[job]\nrecipe = "job_recipe"\n[trainer]\nmax_steps = 2\n'
                                       'global_batch_size = 8\n')
    out = meshtrain_script("train", "job.toml", "--dry-run", "--trainer.layout=dp=1", cwd=tmp_path)
    assert out.returncode == 0 and "config OK" in out.stdout, out.stderr[-2000:]
    out = meshtrain_script("train", "job.toml", "--dry-run", "--trainer.layout=tp=2",
                           "--trainer.devices=2", cwd=tmp_path)
    assert out.returncode == 2 and "config OK" not in out.stdout, out.stdout[-2000:]
    assert "Linear has no tensor-parallel plan" in out.stderr, out.stderr[-2000:]


@pytest.mark.timeout(150)
def test_a_run_planned_with_layout_auto_saves_its_pick(tmp_path):
    """The run folder's config.toml holds the pick, not "auto": it trains the same layout again."""
    config = ROOT / "examples" / "char_gpt.toml"
    out = meshtrain("train", str(config), *TINY, "--trainer.max_steps=2", "--trainer.devices=1",
                    "--trainer.layout=auto", f"--logging.root_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (picked,) = re.findall(r'layout="auto" picked (\S+) mb=(\d+)', out.stdout)
    (run_dir,) = (tmp_path / "char_gpt").iterdir()
    saved = (run_dir / "config.toml").read_text()
    assert 'layout = "auto"' not in saved
    assert f'layout = "{picked[0]}"' in saved and f"micro_batch_size = {picked[1]}" in saved


def test_help_and_version_answer_without_importing_torch():
    """`import meshtrain` binds its public names on first use (PEP 562): the commands that
    train nothing answer at once (0.07 s here, against 4.6 s when the package imported the
    Trainer and torch), and the names still resolve as before."""
    probe = ("import sys, meshtrain\n"
             "from meshtrain.cli import main\n"
             "assert main(['--help']) == 0 and main(['--version']) == 0\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "from meshtrain import Trainer, Layout, losses\n"
             "assert meshtrain.optim.AdamW and losses.GlobalMeanLoss is meshtrain.GlobalMeanLoss\n"
             "assert set(meshtrain.__all__) <= set(dir(meshtrain))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "\nmeshtrain " in out.stdout
