"""``meshtrain parity``'s command line."""

from __future__ import annotations

from meshtrain.errors import ConfigError
from meshtrain.parity.job import Source
from meshtrain.parity.run import parity

USAGE = """usage: meshtrain parity (CONFIG.toml | package.module:function) --layouts "L1;L2;..." \
    [--steps K] [--tol T] [--reference auto|float64|fp32] [--timeout S] [--verbose] \
    [--section.key=value ...]

Trains the job K steps (default 10) in one process and under each layout (separated by ';'),
quietly (--verbose: the runs' own output and warnings), in fp32 and, where the job can be cast
(--reference auto, the default; float64: insist; fp32: never), in float64. A layout passes when,
in float64, every tensor of the final state, every step's loss and gradient norm is within 1e-9
(relative) of one process's, or 10x the model's own float64 floor (one process with another
micro-batch split) where it has one; the fp32 differences are shown beside. A layout that cannot
run in float64 is judged in fp32 (within --tol, or no farther from float64 than 2x one process)
and marked so; parameters with a ~0 gradient are listed, not judged. Prints the first step whose
loss or gradient norm parts and the tensor nearest to its bound. Exits 1 when any layout fails,
errs or is refused.

Example: meshtrain parity examples/char_gpt.toml --layouts "dp=2;zero3=2;tp=2;pp=2" --steps 10"""


def main(argv: list[str]) -> int:
    """``meshtrain parity``: the command line."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    options = {"--layouts": None, "--steps": "10", "--tol": None, "--timeout": "600",
               "--reference": "auto"}
    verbose, rest = False, []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in options:
            options[name] = value if eq else next(args, None)
            if options[name] is None:
                raise ConfigError(f"{name} needs a value; {USAGE.splitlines()[0]}")
        elif arg == "--verbose":
            verbose = True
        else:
            rest.append(arg)
    if not rest or rest[0].startswith("--"):
        raise ConfigError(f"meshtrain parity needs a config file or entry point first\n{USAGE}")
    if not options["--layouts"]:
        raise ConfigError('meshtrain parity needs --layouts, e.g. --layouts "dp=2;zero3=2;tp=2"')
    layouts = [part.strip() for part in options["--layouts"].split(";") if part.strip()]
    try:
        steps, timeout = int(options["--steps"]), float(options["--timeout"])
        tol = None if options["--tol"] is None else float(options["--tol"])
    except ValueError as error:
        raise ConfigError(f"--steps, --tol and --timeout take numbers ({error})") from None
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    rows = parity(Source(rest[0], tuple(rest[1:])), layouts, steps, tol=tol, timeout=timeout,
                  quiet=not verbose, reference=options["--reference"])
    failed = [row.layout + (" (the job's difference: equal to one process cut the same way)"
                            if row.note.startswith("equal") else "")
              for row in rows if not row.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} layouts train like one process"
          + (f"; not: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
