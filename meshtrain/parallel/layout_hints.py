"""What the layout's refusals offer instead (layout.py, the ep check of parallel/expert/): the
names the grammar takes, the closest to a misspelt one, and degrees that fit the processes."""

from __future__ import annotations

import difflib
import math

from meshtrain.errors import LayoutError


def unknown_axis(axis: str, spec, names) -> LayoutError:
    """The refusal of ``axis`` in layout ``spec``: every name of ``names`` (all the grammar
    takes, layout.py's ``NAMES``) and the closest one."""
    close = difflib.get_close_matches(axis, list(names), n=1)
    return LayoutError(f"unknown layout axis {axis!r} in {spec!r}; known axes: "
                       f"{', '.join(names)}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def divisor(data: int, degree: int) -> int:
    """A degree above 1 that divides ``data``: their common divisor, else ``data`` itself."""
    common = math.gcd(data, degree)
    return common if common > 1 else data


def ep_degrees(num_experts: int, ranks: int) -> list[int]:
    """The ep degrees above 1 that split ``num_experts`` evenly over ranks borrowed from
    ``ranks`` data- and context-parallel ranks (both must divide by the degree)."""
    return [d for d in range(2, min(num_experts, ranks) + 1)
            if num_experts % d == 0 and ranks % d == 0]


def ep_advice(num_experts: int, ranks: int) -> str:
    """What to write instead of an ep that does not divide ``num_experts``: the degrees that
    fit the ``ranks`` it borrows, else how to train without ep."""
    fits = ep_degrees(num_experts, ranks)
    if fits:
        return f"pick ep among {fits} (the ones dividing both the experts and the {ranks} " \
               "data-parallel ranks)"
    smallest = next(d for d in range(2, num_experts + 1) if num_experts % d == 0)
    return (f"no ep above 1 divides both the {num_experts} experts and the {ranks} "
            f"data-parallel ranks it borrows: drop ep (each rank then holds every expert), or "
            f"make those ranks a multiple of {smallest} (e.g. layout=\"ep={smallest}\" on "
            f"{smallest} processes)")
