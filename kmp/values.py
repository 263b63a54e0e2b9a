"""The value checks every kmp setting goes through. Imports no TensorFlow.

A number is what Python and numpy call one (`np.int64(2)`, `np.float32(0.5)`
included); a boolean is not. Every numeric setting ends up in a float32 or
int64 variable or tensor, so ranges are checked against what those can hold:
a value that would become inf, or wrap around, is an error here, not a
silent change at the first step.

Each check appends `Problem`s to a list and returns whether the value was
fine, so callers collect every problem of a setup into one ConfigError.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from kmp.errors import Problem, did_you_mean

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
INT64_MAX = 2**63 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (JSON's NaN and Infinity are not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def plain(value: Any) -> Any:
    """numpy scalars as the Python number they hold; anything else unchanged."""
    # type(), not isinstance: numpy.float64 subclasses float.
    if isinstance(value, numbers.Number) and type(value) not in (int, float, bool, complex):
        item = getattr(value, "item", None)
        if callable(item):
            return item()
    return value


def int_in(path: str, value: Any, low: int, out: list[Problem], high: int = INT64_MAX, fix: str = "") -> bool:
    if is_int(value) and low <= value <= high:
        return True
    # The upper bound is named only where it matters: most are int64's.
    above = is_int(value) and value > high
    if high < INT64_MAX or above:
        expected = f"an integer from {low} to {high}" + (" (int64's largest)" if high == INT64_MAX else "")
    else:
        expected = f"an integer >= {low}"
    out.append(Problem(path, expected, value, fix))
    return False


def number_in(
    path: str,
    value: Any,
    out: list[Problem],
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float = FLOAT32_MAX,
    fix: str = "",
) -> bool:
    """A finite number within the given bounds (float32's range by default)."""
    ok = is_number(value)
    if ok:
        ok = (above is None or value > above) and (at_least is None or value >= at_least)
        ok = ok and (below is None or value < below) and value <= at_most
    if ok:
        return True
    bounds = [f"> {above:g}" if above is not None else None, f">= {at_least:g}" if at_least is not None else None,
              f"< {below:g}" if below is not None else None,
              f"<= {at_most:g}" + (" (float32's largest)" if at_most == FLOAT32_MAX else "")]
    out.append(Problem(path, "a finite number " + " and ".join(b for b in bounds if b), value, fix))
    return False


def positive(path: str, value: Any, out: list[Problem], fix: str = "") -> bool:
    """A finite number > 0 that float32 holds as a normal number (neither 0 nor inf)."""
    return number_in(path, value, out, at_least=FLOAT32_TINY, fix=fix)


def boolean(path: str, value: Any, out: list[Problem]) -> bool:
    if isinstance(value, bool):
        return True
    out.append(Problem(path, "true or false", value))
    return False


def choice(path: str, value: Any, choices: tuple[str, ...], out: list[Problem], fix: str = "") -> bool:
    # isinstance first: an unhashable value (a list) must be a Problem, not a TypeError.
    if isinstance(value, str) and value in choices:
        return True
    hint = did_you_mean(value, choices) if isinstance(value, str) else ""
    out.append(Problem(path, f"one of {', '.join(repr(c) for c in choices)}", value, (fix + " " + hint).strip()))
    return False
