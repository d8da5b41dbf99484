"""The ``meshtrain`` command line.

    meshtrain train CONFIG.toml [--section.key=value ...]    train the job a config describes
    meshtrain lr-find CONFIG.toml [--section.key=value ...]  learning-rate range test for it
    meshtrain memory CONFIG.toml [--section.key=value ...]   per-rank model-state memory (1 step)
    meshtrain run [torchrun flags] script.py [args]          start a script on N processes
    meshtrain slurm --nodes N --gpus-per-node G script.py    write (and submit) an sbatch script
    meshtrain export CHECKPOINT_DIR model.pt                 checkpoint -> one plain state_dict file
    meshtrain --version
"""

from __future__ import annotations

import sys

from meshtrain import __version__
from meshtrain.errors import ConfigError

USAGE = __doc__


def _recipe(argv: list[str], mode: str) -> int:
    from meshtrain.recipes import run_config

    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: meshtrain {mode} CONFIG.toml [--section.key=value ...]\n\nExample: "
              f"meshtrain {mode} examples/char_gpt.toml --trainer.layout=zero3=2")
        return 0 if argv else 2
    run_config(argv[0], argv[1:], mode=mode)
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
        if command == "run":
            from meshtrain.launch.torchrun import run

            return run(rest)
        if command == "export":
            from meshtrain.checkpoint.export import export

            return export(rest)
        if command == "slurm":
            from meshtrain.launch.slurm import slurm

            return slurm(rest)
        raise ConfigError(
            f"unknown command {command!r}; commands: train, lr-find, memory, run, slurm, export (see --help)"
        )
    except ConfigError as error:
        print(f"meshtrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
