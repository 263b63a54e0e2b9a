"""What kmp keeps on a user's model: one object, in `model.__dict__["_kmp"]`.

kmp.prepare's settings and kmp.engine's caches for that model live in one
`Prepared`. It is set in the instance's __dict__, not as an attribute, so
that Keras's attribute tracking never sees it: it is not saved, checkpointed
or cloned (docs/keras-changes.md lists it).

    state.of(model)       the model's Prepared, or None
    state.ensure(model)   the model's Prepared, made on first use
    state.setting(model, "jit_compile")   prepare's setting, or its default on a model not prepared

A leaf: imports nothing of kmp.
"""

from __future__ import annotations

import dataclasses
from typing import Any

KEY = "_kmp"
SETTINGS = ("jit_compile", "find_overflow_layer", "flat_buffers", "wall_clock_breakdown",
            "activation_checkpointing")  # prepare's arguments


@dataclasses.dataclass(eq=False)
class Prepared:
    # kmp.prepare's arguments. The defaults are what a model not prepared is read with
    # (`kmp memory`: prepare.flat_reason), not prepare's own: there flat_buffers is "auto".
    jit_compile: bool | str = "auto"
    find_overflow_layer: bool = True
    flat_buffers: bool | str = False
    wall_clock_breakdown: bool | int | str = "auto"
    activation_checkpointing: bool | str | tuple = "auto"
    prepared: bool = False  # kmp.prepare(model) was called: the five above are what it was given

    # Caches, made when first needed.
    engine: Any = None  # kmp.engine.engine.Engine: the flat buffers fit() trains
    engine_methods: bool = False  # kmp.engine.engine.install wrapped the model's methods
    overflow_layer: Any = None  # kmp.engine.overflow_layer.State: the layer found after an overflow
    path: dict = dataclasses.field(default_factory=lambda: {"taken": None, "dropped": {}, "off": {}})  # path_of
    replica_steps: dict = dataclasses.field(default_factory=dict)  # replica_step's XLA functions, by replica_key()
    last_pass: Any = None  # replica_step.in_turn: the last traced replica's forward/backward output
    rows_noted: bool = False  # replica_step said once that uneven shares are weighted per replica
    xla_noted: bool = False  # replica_step said once that the forward/backward runs without XLA (xla_choice)
    flat_noted: set = dataclasses.field(default_factory=set)  # why the flat buffers are off, each said once

    @property
    def settings(self) -> tuple:
        return tuple(getattr(self, name) for name in SETTINGS)


_DEFAULTS = Prepared()  # read by setting() only


def of(model) -> Prepared | None:
    """The model's Prepared, or None if kmp keeps nothing on it."""
    return model.__dict__.get(KEY)


def ensure(model) -> Prepared:
    """The model's Prepared, set in its __dict__ on first use (Keras's tracking never sees it)."""
    found = of(model)
    if found is None:
        found = model.__dict__[KEY] = Prepared()
    return found


def setting(model, name: str) -> Any:
    """kmp.prepare's setting `name` for the model; on a model not prepared, its default (Prepared's)."""
    if name not in SETTINGS:  # a cache is read through of() or ensure(): _DEFAULTS' would be shared
        raise KeyError(name)
    return getattr(of(model) or _DEFAULTS, name)
