"""``meshtrain sweep CONFIG.toml --space SPACE.toml [flags] [--section.key=value ...]``."""

from __future__ import annotations

import argparse

from meshtrain.errors import ConfigError

HELP = """Run (or continue) a hyperparameter search over the job CONFIG.toml: trials run as
`meshtrain train CONFIG.toml --key=value ...`, several at once on disjoint devices. The space
file says what to search and the objective (see meshtrain/sweep/space.py); the flags below
override its [sweep] table. Running the same command again continues the sweep (trials left
running resume from their last checkpoint)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtrain sweep", description=HELP)
    p.add_argument("config", help="the job's TOML config")
    p.add_argument("--space", required=True, help="the search space and objective (TOML)")
    p.add_argument("--trials", type=int, help="the trial budget")
    p.add_argument("--devices-per-trial", type=int, help="CPU cores (or GPUs) per trial")
    p.add_argument("--concurrent", type=int, help="trials at once (0: as many as fit)")
    p.add_argument("--pruner", help="median, hyperband or none")
    p.add_argument("--sampler", help="tpe or random")
    p.add_argument("--seed", type=int, help="the sampler's seed; trial k trains with seed + k")
    p.add_argument("--storage", help="a database URL (default: SQLite in the sweep folder)")
    p.add_argument("--study", help="the study's name (default: the job's name)")
    p.add_argument("--dir", help="the sweep folder (default: root_dir/name/sweep)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the space and the objective against the job, print the split of "
                   "the machine and the space; start nothing")
    return p


def main(argv: list[str]) -> int:
    from meshtrain.sweep.controller import run_sweep

    args, rest = parser().parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=")[0])]
    if bad:
        raise ConfigError(f"meshtrain sweep: cannot read {' '.join(bad)}; config overrides are "
                          "--section.key=value (see meshtrain sweep --help)")
    flags = dict(trials=args.trials, devices_per_trial=args.devices_per_trial,
                 concurrent=args.concurrent, pruner=args.pruner, sampler=args.sampler,
                 seed=args.seed, storage=args.storage, study=args.study)
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("meshtrain sweep needs Optuna: pip install 'meshtrain[sweep]' "
                          "(or pip install optuna)") from None
    run_sweep(args.config, args.space, overrides=rest, sweep_dir=args.dir,
              dry_run=args.dry_run, **flags)
    return 0
