"""Error types, and the one message format every kmp error uses.

A message says what was expected, what was received (with the key path for
config values), and what to do. Config problems are collected and reported
together, so a user fixes a file once, not once per problem.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


class KmpError(Exception):
    """Base class of the errors kmp raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One invalid setting: where it is, what it should be, what it was."""

    path: str
    expected: str
    received: Any
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.path}: expected {self.expected}. Received: {self.path}={_shown(self.received)}."
        return f"{text} {self.fix}" if self.fix else text


def _shown(value: Any, limit: int = 200) -> str:
    """repr(value), shortened: a 5,000-digit int or a huge list must not drown the message."""
    try:
        text = repr(value)
    except ValueError:  # int too long for repr (Python's 4,300-digit limit)
        return f"<an integer of about {value.bit_length() * 30103 // 100000} digits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ConfigError(KmpError, ValueError):
    """Invalid settings. `problems` lists every problem found, not the first."""

    def __init__(self, problems: Iterable[Problem], source: str = "kmp settings"):
        self.problems = tuple(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        super().__init__(
            f"Invalid {source} ({count} {noun}):\n{lines}\n"
            "Fix the values above; nothing was changed."
        )


class LossScaleError(KmpError, RuntimeError):
    """The loss scale is at its floor and gradients still overflow; or a layer's float16 output overflowed,
    which no scale fixes (then `layer` is its name)."""


def loose(name: str) -> str:
    """`name` without case and separators: 'BF-16' and 'bf_16' are both 'bf16'."""
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A 'Did you mean ...?' hint for a misspelled name, or ''.

    The choice spelled the same but for case and separators comes first;
    else the closest by difflib, as written, then in lower case.
    """
    choices = list(choices)
    close = ([choice for choice in choices if loose(choice) == loose(name)]
             or difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
             or difflib.get_close_matches(name.lower(), choices, n=1, cutoff=0.6))
    return f"Did you mean '{close[0]}'?" if close else ""


def check(problems: list[Problem], source: str = "kmp settings") -> None:
    """Raise one ConfigError listing all `problems`, if there are any."""
    if problems:
        raise ConfigError(problems, source)
