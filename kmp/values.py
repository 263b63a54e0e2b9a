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
import struct
from typing import Any

from kmp.errors import Problem, did_you_mean

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
INT64_MAX = 2**63 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (JSON's NaN and Infinity are not, nor an int too large for any float)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # 10**400 (JSON text can hold it), or a Fraction that large
        return False


def plain(value: Any) -> Any:
    """numpy scalars, Fractions and other real numbers as the Python int or float they hold; the rest unchanged."""
    # type(), not isinstance: numpy.float64 subclasses float.
    if isinstance(value, numbers.Number) and type(value) not in (int, float, bool, complex):
        item = getattr(value, "item", None)
        if callable(item):
            value = item()
        # numpy.longdouble.item() is a longdouble; a Fraction has no item().
        if type(value) in (int, float):
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real) and is_number(value):
            return float(value)
    return value


def float32(value: float) -> float:
    """`value` rounded to float32, as the variable or tensor that holds it does (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def key_name(key: Any) -> str:
    """A key as a path segment: as written, or quoted when it would not show (empty, padded) or is no string."""
    return key if isinstance(key, str) and key and key.strip() == key else repr(key)


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
    """A finite number within the given bounds (float32's range by default), before and after rounding to float32.

    The rounding matters at the open bounds: a growth factor of 1.0000000001
    is 1.0 in float32, and the scale would never grow.
    """

    def within(x: float) -> bool:
        ok = (above is None or x > above) and (at_least is None or x >= at_least)
        return ok and (below is None or x < below) and x <= at_most

    # Compared as a Python number: a bound converted to numpy.float16 is rounded (2.0**20 becomes inf).
    ok = is_number(value) and within(plain(value))
    if ok and within(float32(plain(value))):
        return True
    if ok:
        fix = f"{fix} It is {float32(plain(value))!r} in float32, the type it is computed in.".strip()
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
