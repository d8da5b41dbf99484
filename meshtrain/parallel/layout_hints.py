"""What the layout's refusals offer instead (layout.py): the names the grammar takes, the
closest to a misspelt one, and degrees that fit the processes."""

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

