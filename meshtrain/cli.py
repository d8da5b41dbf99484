"""The ``meshtrain`` command line.

    meshtrain train CONFIG.toml [--section.key=value ...]    train the job a config describes
    meshtrain lr-find CONFIG.toml [--section.key=value ...]  learning-rate range test for it
    meshtrain memory CONFIG.toml [--section.key=value ...]   per-rank model-state memory (1 step)
        --dry-run: print the resolved config (every setting), make every check train makes
        before any process starts (the model against the layout on a meta-device copy), exit
    meshtrain parity CONFIG.toml --layouts "dp=2;tp=2;pp=2" [--steps K] [--section.key=value ...]
        train K steps in one process and under each layout; compare (exit 1 if any differs)
    meshtrain run [torchrun flags] script.py [args]          start a script on N processes
    meshtrain slurm --nodes N --gpus-per-node G script.py    write (and submit) an sbatch script
    meshtrain export CHECKPOINT_DIR model.pt                 checkpoint -> one plain state_dict file
    meshtrain export CHECKPOINT_DIR --hf OUT_DIR             checkpoint -> a Hugging Face model folder
    meshtrain upgrade-checkpoint CHECKPOINT_DIR --trust      an older meshtrain's checkpoint -> one
        that loads safely (docs/security.md)
    meshtrain bench comm --devices N [--json FILE]           collectives' time and bus bandwidth
        (1 KiB-256 MiB) on N local processes, or on a launcher's world
    meshtrain plan MODEL --cluster 8xH100 --nodes N --global-batch B --seq-len S [--json FILE]
        every legal layout ranked by estimated step time, with memory; why the others are refused
    meshtrain prepare INPUT... --out DIR (--tokenizer tokenizer.json | --train-tokenizer N)
        text / JSON lines -> memory-mapped token shards for the causal_lm recipe
    meshtrain report RUN_DIR                                 RUN_DIR/report.html: one page of
        a run (loss, throughput and MFU, step-time breakdown and memory per rank, events)
    meshtrain sweep CONFIG.toml --space SPACE.toml [--trials N] [--devices-per-trial K]
        [--concurrent N] [--storage URL] [--dry-run] [--section.key=value ...]
        hyperparameter search (Optuna): trials at once on disjoint devices, resumable
    meshtrain --version
"""

from __future__ import annotations

import sys

from meshtrain import __version__
from meshtrain.errors import ConfigError

#: every command, with one line (``meshtrain --help``; the module's doc has the forms)
COMMANDS = {
    "train": "train the job a config describes (CONFIG.toml [--section.key value ...])",
    "lr-find": "learning-rate range test of a config's job",
    "memory": "per-rank model-state memory of a config's job (one step)",
    "parity": "train K steps in one process and under each layout, and compare",
    "run": "start a script on N processes (torchrun's flags)",
    "slurm": "write (and submit) an sbatch script for a script",
    "export": "a checkpoint as one state_dict file, or as a Hugging Face folder (--hf)",
    "upgrade-checkpoint": "an older meshtrain's checkpoint made safe to load (--trust)",
    "bench": "collectives' time and bandwidth on this machine (bench comm)",
    "plan": "every legal layout of a model on a cluster, ranked by estimated step time",
    "prepare": "text or JSON lines -> token shards for the causal_lm recipe",
    "report": "a run folder's one-page report (report.html)",
    "sweep": "hyperparameter search (Optuna) over a config's job",
}
USAGE = ("usage: meshtrain COMMAND [ARGS ...]   (meshtrain COMMAND --help: its arguments)\n\n"
         "commands:\n" + "".join(f"  {name:<20}{text}\n" for name, text in COMMANDS.items())
         + "  --version           meshtrain's version\n\nforms:\n"
         + __doc__.split("\n", 2)[2].rstrip() + "\n\nA config's settings: meshtrain train "
         "--help, docs/reference.md.")


def _recipe(argv: list[str], mode: str) -> int:
    from meshtrain.recipes import resolve_config, run_config
    from meshtrain.settings.reference import help_text
    from meshtrain.settings.torchtitan import config_file_first

    argv = config_file_first(argv)  # torchtitan's --job.config_file PATH: the config

    if not argv or "-h" in argv or "--help" in argv:
        config = None
        if argv and not argv[0].startswith("-"):  # CONFIG --help: its settings, resolved
            config = resolve_config(argv[0], [a for a in argv[1:]
                                              if a not in ("-h", "--help", "--dry-run")])[1]
        print(f"usage: meshtrain {mode} CONFIG.toml [--dry-run] [--quiet] [--section.key value "
              "...]\n\n--quiet: the meshtrain logger at WARNING (no progress lines; the run's "
              "files are written as always).\n"
              "--dry-run prints the resolved config (every section and setting), makes every "
              "check train makes before any process starts (settings, data, the model against "
              "the layout on a meta-device copy) and exits without training. A setting is "
              "written --section.key value or --section.key=value (docs/reference.md).\n\n"
              f"Example: meshtrain {mode} examples/char_gpt.toml --trainer.layout zero3=2 "
              "--parallel.activation_checkpointing full\n\n"
              + ("settings of this config:" if config is not None else "settings:")
              + "\n\n" + help_text(config))
        return 0 if argv else 2
    dry_run = "--dry-run" in argv
    if "--quiet" in argv:  # the meshtrain logger at WARNING: no progress lines (observe/run_log.py)
        import logging

        logging.getLogger("meshtrain").setLevel(logging.WARNING)
    args = [a for a in argv if a not in ("--dry-run", "--quiet")]
    if not args or args[0].startswith("--"):
        raise ConfigError(f"meshtrain {mode} needs the config file first: "
                          f"meshtrain {mode} CONFIG.toml [--dry-run] [--section.key=value ...]")
    run_config(args[0], args[1:], mode=mode, dry_run=dry_run)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "--version":
            print(f"meshtrain {__version__}")
            return 0
        if command in ("train", "lr-find", "memory"):
            return _recipe(rest, command)
        if command == "parity":
            from meshtrain.parity import main as parity

            return parity(rest)
        if command == "run":
            from meshtrain.launch.torchrun import run

            return run(rest)
        if command == "export":
            from meshtrain.checkpoint.export import export

            return export(rest)
        if command == "upgrade-checkpoint":
            from meshtrain.checkpoint.upgrade import main as upgrade

            return upgrade(rest)
        if command == "bench":
            if not rest or rest[0] != "comm":
                raise ConfigError("meshtrain bench takes one benchmark: meshtrain bench comm "
                                  "--devices N (see meshtrain bench comm --help)")
            from meshtrain.plan.bench_comm import main as bench_comm

            return bench_comm(rest[1:])
        if command == "plan":
            from meshtrain.plan.planner import main as plan

            return plan(rest)
        if command == "prepare":
            from meshtrain.data.prepare import main as prepare

            return prepare(rest)
        if command == "report":
            from meshtrain.observe.report.render import main as report

            return report(rest)
        if command == "sweep":
            from meshtrain.sweep.cli import main as sweep

            return sweep(rest)
        if command == "slurm":
            from meshtrain.launch.slurm import slurm

            return slurm(rest)
        raise ConfigError(f"unknown command {command!r}; commands: {', '.join(COMMANDS)} "
                          "(see meshtrain --help)")
    except ConfigError as error:
        print(f"meshtrain: error: {error}", file=sys.stderr)
        from meshtrain.launch.endings import ends_with

        ends_with(error, 2)  # (a rank of a job: its exit code, and its launcher names it)
        return 2


if __name__ == "__main__":
    sys.exit(main())
