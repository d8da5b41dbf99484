"""The ``meshtrain`` command line.

    meshtrain train CONFIG.toml [--section.key=value ...]    train the job a config describes
    meshtrain lr-find CONFIG.toml [--section.key=value ...]  learning-rate range test for it
    meshtrain run [torchrun flags] script.py [args]          start a script on N processes
    meshtrain slurm --nodes N --gpus-per-node G script.py    write (and submit) an sbatch script
    meshtrain --version
"""

from __future__ import annotations

import sys

from meshtrain import __version__
from meshtrain.errors import ConfigError

USAGE = __doc__


def _train(argv: list[str], lr_find: bool = False) -> int:
    from meshtrain.recipes import run_config

    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: meshtrain {'lr-find' if lr_find else 'train'} CONFIG.toml "
              "[--section.key=value ...]\n\nExample: meshtrain train examples/char_gpt.toml "
              "--trainer.max_steps=50")
        return 0 if argv else 2
    run_config(argv[0], argv[1:], lr_find=lr_find)
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
        if command == "train":
            return _train(rest)
        if command == "lr-find":
            return _train(rest, lr_find=True)
        if command == "run":
            from meshtrain.launch.torchrun import run

            return run(rest)
        if command == "slurm":
            from meshtrain.launch.slurm import slurm

            return slurm(rest)
        raise ConfigError(
            f"unknown command {command!r}; commands: train, lr-find, run, slurm (see --help)"
        )
    except ConfigError as error:
        print(f"meshtrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
