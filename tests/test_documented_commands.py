"""The shell commands README.md and docs/*.md show, run as a reader copies them.

Every line of a ```bash block that starts with ``meshtrain`` or ``make`` (continuation lines
joined, the trailing comment dropped) is listed in ``HOW`` with what is done with it:

- ``ran()``: run here, as written, in a scratch folder whose ``examples/`` is the repository's,
  in the order the docs show them; what a reader fills in (``<time>``, ``OLD_CHECKPOINT_DIR``,
  ``my_script.py``, ``space.toml``) is filled with what the commands before made, or with the
  docs' own example file;
- ``ran(changed=...)``: run with the change named, only where as written it takes minutes
  (measured on the 2-core machine);
- ``elsewhere(test, ...)``: run by that test (as written or with the changes it names), so
  not twice;
- ``not_run(why)``: this machine cannot (other nodes, GPUs, Slurm's daemons, a reader's file).

A command added to the docs, or changed there, fails the first test until it is listed here:
a documented command is either run or said not to be, with the reason.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshtrain import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class How:
    kind: str  # "ran", "elsewhere" or "not_run"
    shows: str = ""  # ran: what its output says when it worked
    changed: dict = field(default_factory=dict)  # ran: argument -> argument, "" appends
    why: str = ""
    test: str = ""  # elsewhere: path::function


def ran(shows: str, changed: dict | None = None, why: str = "") -> How:
    return How("ran", shows=shows, changed=changed or {}, why=why)


def elsewhere(test: str, why: str = "as written") -> How:
    return How("elsewhere", test=test, why=why)


def not_run(why: str) -> How:
    return How("not_run", why=why)


CLI = "tests/test_cli.py::"
SLURM_RUN = "tests/launch/test_slurm_cluster.py::" \
            "test_a_submitted_job_trains_and_a_cancelled_one_resumes_when_submitted_again"
HOW = {
    "make demo": elsewhere(CLI + "test_train_main_job_on_two_processes",
                           "its `meshtrain train examples/char_gpt.toml`, tiny and 40 steps "
                           "(the demo trains for about two minutes)"),
    "make test": not_run("the test suite itself"),
    "meshtrain train examples/char_gpt.toml --trainer.max_steps=100 --model.num_layers=2":
        ran("fit: 2 steps", {"--trainer.max_steps=100": "--trainer.max_steps=2"},
            "100 steps take 33 s, 2 steps 9 s"),
    "meshtrain train examples/char_gpt.toml --dry-run --trainer.layout=pp=2 "
    "--pipeline.pp_schedule=gpipe": elsewhere(CLI + "test_the_readme_dry_runs_pass"),
    "meshtrain lr-find examples/char_gpt.toml":
        elsewhere(CLI + "test_lr_find_writes_a_plot_and_suggests_a_rate",
                  "with a tiny model on 1 process (as written: 57 s)"),
    "meshtrain memory examples/char_gpt.toml --trainer.layout=zero3=2":
        elsewhere(CLI + "test_memory_prints_measured_and_predicted_model_state",
                  "with a tiny model"),
    "meshtrain parity examples/char_gpt.toml --layouts 'dp=2;tp=2;pp=2' --steps 10":
        elsewhere("tests/test_parity_command.py::test_char_gpt_layouts_match_one_process",
                  "with a smaller model and fewer steps (as written: 157 s)"),
    "meshtrain export 'runs/char_gpt/<time>/checkpoints/final' model.pt":
        ran("wrote model.pt"),
    "meshtrain upgrade-checkpoint OLD_CHECKPOINT_DIR --trust":
        ran("nothing to change"),  # on a current checkpoint: the upgrade itself is elsewhere
    "meshtrain bench comm --devices 2 --json comm.json":
        elsewhere("tests/plan/test_bench_comm.py::test_two_processes_time_every_operation",
                  "with --max-size 16KiB (as written, up to 256 MiB: 52 s)"),
    "meshtrain plan examples/llama3/70b.json --nodes 8 --global-batch 64 --seq-len 8192":
        ran("would cross nodes"),
    "meshtrain train examples/char_gpt.toml --trainer.layout=auto --dry-run":
        elsewhere(CLI + "test_the_readme_dry_runs_pass"),
    "meshtrain run --nproc-per-node 2 my_script.py --my-arg 1":
        ran("rank 1 of 2 ['--my-arg', '1']"),
    "meshtrain run --nproc-per-node 2 --max-restarts 3 my_script.py": ran("rank 1 of 2 []"),
    "meshtrain run --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d "
    "--rdzv-endpoint HEAD:29500 --rdzv-id job my_script.py":
        not_run("several nodes, each with 8 processes (tests/launch/test_multinode.py: two "
                "agents on this machine)"),
    "meshtrain slurm --nodes 4 --gpus-per-node 8 my_script.py": ran("meshtrain.sbatch"),
    "meshtrain slurm --nodes 1 --nproc-per-node 2 --submit -m meshtrain train job.toml":
        elsewhere(SLURM_RUN, "on a one-node Slurm cluster, with its own job.toml"),
    "meshtrain sweep examples/char_gpt.toml --space space.toml --trials 8 "
    "--devices-per-trial 1": ran("dry run: no trial was started", {"": "--dry-run"},
                                 "8 trials take minutes: the dry run checks the command, "
                                 "the space and the objective"),
    "meshtrain --version": ran("meshtrain "),
    # docs/
    "meshtrain run --nproc-per-node 8 --max-restarts 3 train.py":
        not_run("8 processes of the reader's train.py: the README's 2-process form runs"),
    "meshtrain run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
    "HEAD_NODE:29500 --rdzv-id my-job train.py": not_run("two nodes"),
    "meshtrain run --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d "
    "--rdzv-endpoint HEAD_NODE:29500 --rdzv-id my-job train.py":
        not_run("several nodes (tests/launch/test_multinode.py: two agents on this machine)"),
    "meshtrain slurm --nodes 4 --gpus-per-node 8 --time 04:00:00 --submit -m meshtrain train "
    "job.toml": not_run("a Slurm cluster with GPUs"),
    "meshtrain slurm --nodes 2 --nproc-per-node 16 --cpus-per-task 32 --submit train.py":
        not_run("a two-node Slurm cluster"),
    "meshtrain slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --requeue-before 300 --submit "
    "-m meshtrain train job.toml": not_run("a Slurm cluster with GPUs (the requeue: "
                                           "tests/launch/test_slurm_cluster.py)"),
    "meshtrain prepare '/usr/lib/python3.11/*.py' --out runs/llm_data --train-tokenizer 4096 "
    "--val-fraction 0.05":
        elsewhere("tests/data/test_prepare.py::test_prepare_trained_tokenizer_round_trip",
                  "on a small input (`make llm` runs it on this Python's own library)"),
    "meshtrain train examples/llama_tiny.toml":
        not_run("minutes, on the shards the prepare command writes (`make llm`: 2 min 37 s)"),
    "meshtrain export 'runs/llama_tiny/<time>/checkpoints/final' --hf "
    "'runs/llama_tiny/<time>/hf' --tokenizer 'runs/llama_tiny/<time>'":
        not_run("the llama_tiny run above (`make llm` runs it)"),
    "meshtrain train examples/llama_tiny.toml '--logging.loggers=[\"csv\", \"mlflow\"]'":
        not_run("minutes, as the llama_tiny run above"),
    "meshtrain parity examples/char_gpt.toml --layouts 'dp=2;zero3=2;tp=2;pp=2' --steps 10 "
    "--model.num_layers=2 --model.d_model=64":
        elsewhere("tests/test_parity_command.py::test_char_gpt_layouts_match_one_process",
                  "with fewer steps and layouts"),
    "meshtrain parity mypkg.train:job --layouts 'tp=2;dp_shard=2,tp=2'":
        elsewhere("tests/test_parity_command.py::"
                  "test_a_job_with_its_own_tp_plan_checks_against_one_process",
                  "with its own entry point"),
    "meshtrain upgrade-checkpoint runs/job/20261101-120000/checkpoints/final --trust":
        not_run("an example path: the README's form runs here"),
    "meshtrain sweep examples/char_gpt.toml --space space.toml --dry-run":
        ran("dry run: no trial was started"),
}

#: commands that start processes of their own run as the installed command; others run by the
#: command's main in this process (as tests/test_cli.py does), which is quicker
SUBPROCESS = ("train", "run")

MY_SCRIPT = """import os, sys
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], sys.argv[1:], flush=True)
"""


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for each ``meshtrain``/``make`` line of the docs' bash blocks, in order;
    the command as ``shlex.join`` writes its arguments."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", path.read_text(), re.S):
            lines = block.splitlines()
            while lines:
                line = lines.pop(0).strip()
                while line.endswith("\\") and lines:
                    line = line[:-1] + " " + lines.pop(0).strip()
                if line.startswith(("meshtrain ", "make ")):
                    found.append((path.name, shlex.join(shlex.split(line, comments=True))))
    return found


def _test_exists(test: str) -> bool:
    path, name = test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_documented_command_is_accounted_for():
    documented = documented_commands()
    commands = {command for _, command in documented}
    new = sorted(f"{where}: {command}" for where, command in documented if command not in HOW)
    assert not new, ("documented commands this file does not know: list each in HOW, run here "
                     "(as written, or with a change where it takes minutes), run elsewhere or "
                     "not run with the reason:\n" + "\n".join(new))
    gone = sorted(set(HOW) - commands)
    assert not gone, f"HOW lists commands the docs no longer show: {gone}"
    missing = [how.test for how in HOW.values() if how.kind == "elsewhere"
               and not _test_exists(how.test)]
    assert not missing, f"HOW names tests that do not exist: {missing}"
    assert all(how.why for how in HOW.values() if how.kind == "not_run")


def _fill(argv: list[str], work: Path) -> list[str]:
    """What a reader fills in: the run the commands before made."""
    runs = sorted(work.glob("runs/char_gpt/*/checkpoints/final"))
    run = runs[-1].parents[1] if runs else None
    out = []
    for arg in argv:
        if "<time>" in arg or arg == "OLD_CHECKPOINT_DIR":
            assert run is not None, f"{arg}: no run before it made a checkpoint"
            arg = arg.replace("<time>", run.name).replace(
                "OLD_CHECKPOINT_DIR", str(run.relative_to(work) / "checkpoints" / "final"))
        out.append(arg)
    return out


@pytest.mark.timeout(300)
def test_the_documented_commands_run(tmp_path, monkeypatch, capsys):
    """Each command ``HOW`` marks ``ran``, in the docs' order, with the changes it names."""
    work = tmp_path
    (work / "examples").symlink_to(ROOT / "examples")
    (work / "my_script.py").write_text(MY_SCRIPT)
    sweep_doc = (ROOT / "docs" / "sweep.md").read_text()
    (work / "space.toml").write_text(re.search(r"```toml\n(.*?)```", sweep_doc[sweep_doc.index(
        "## The space file"):], re.S).group(1))
    monkeypatch.chdir(work)
    script = Path(sys.executable).parent / "meshtrain"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = set()
    for where, command in documented_commands():
        how = HOW[command]
        if how.kind != "ran":
            continue
        argv = shlex.split(command)
        for old, new in how.changed.items():
            argv = argv + [new] if old == "" else [new if a == old else a for a in argv]
        argv = _fill(argv, work)
        if command in done:  # shown twice (README and a doc)
            continue
        done.add(command)
        if argv[1] in SUBPROCESS and "--dry-run" not in argv:
            finished = subprocess.run([str(script), *argv[1:]], cwd=work, env=env,
                                      capture_output=True, text=True, timeout=240)
            code, out, err = finished.returncode, finished.stdout, finished.stderr
        else:
            code = cli.main(argv[1:])
            out, err = capsys.readouterr()
        assert code == 0 and how.shows in out, (where, shlex.join(argv), code, out[-2000:],
                                                err[-3000:])
    assert done == {command for command, how in HOW.items() if how.kind == "ran"}
