"""Fuzzed optimizer and scheduler blocks and "auto" fills: kmp's error with a key path, or a sound result.

The same rule as tests/test_config_fuzz.py, for the blocks issue 11 added:
no deep traceback, nothing out of range accepted. An accepted optimizer
block builds a Keras optimizer whose numbers are finite and in range; an
accepted scheduler gives finite, non-negative learning rates (and momenta
in [0, 1]) at every step tried, in Python and as the Keras schedule.
"""

import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kmp
from kmp.config.optimizer_block import OPTIMIZERS, keras_arguments
from kmp.schedules.formulas import PARAMETERS, REQUIRED, SCHEDULERS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VALUES = [0, 1, -1, 0.5, 1.0, -0.5, 2.0, 1e-8, 1e-300, 1e39, 3.5e38, math.nan, math.inf, -math.inf, 2**63, 10**400,
          0.9, 0.999, 0.99, 1000, 2000, True, False, None, "", "auto", "log", "linear", "cos", "1e-3", [], [0.9],
          [0.9, 0.999], [0.9, 1.0], [-0.1, 0.5], [0.9, "x"], {}, {"a": 1}, np.float32(0.5), np.int64(10)]


def fuzz(max_examples):
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _block(kinds, params):
    @st.composite
    def block(draw):
        # Mostly real types and parameter names, sometimes not: accepted blocks must be common enough to check.
        kind = draw(st.one_of(st.sampled_from(kinds), st.sampled_from(kinds), st.sampled_from(kinds),
                              st.sampled_from(["adamm", "sgd", "RMSprop", "", 3, None])))
        names = sorted(params.get(kind, {})) if isinstance(kind, str) else []
        key = st.one_of(*[st.sampled_from(names)] * 4, st.sampled_from(["lr", "betas", "max_grad_norm", "bogus"])) \
            if names else st.sampled_from(["lr", "betas", "bogus"])
        keys = draw(st.lists(key, max_size=5, unique=True))
        if draw(st.integers(0, 4)) != 4:  # the parameters without a default, mostly given
            keys += [k for k, v in params.get(kind, {}).items() if v is REQUIRED and k not in keys]
        plausible = st.one_of(st.floats(0, 1), st.integers(1, 3000), st.sampled_from(["log", "linear", True, False]))
        junk = st.sampled_from(VALUES)
        out = {"type": kind, "params": {k: draw(st.one_of(plausible, plausible, junk)) for k in keys}}
        if draw(st.integers(0, 4)) == 4:
            out[draw(st.sampled_from(["param", "legacy_fusion", "extra"]))] = 1
        return out
    return block()


def _ends_well(call):
    try:
        return call()
    except kmp.ConfigError as error:
        assert error.problems and all(p.path.strip() and p.path in str(error) for p in error.problems)
        return None


@fuzz(400)
@example({"type": "Adam", "params": {"betas": [0.9, 1.0]}})
@example({"type": "Lion", "params": {"lr": 1e39}})
@given(_block(["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"],
              {**OPTIMIZERS, **{k.capitalize(): v for k, v in OPTIMIZERS.items()}}))
def test_optimizer_blocks(block):
    config = _ends_well(lambda: kmp.load_config({"optimizer": block}))
    if config is None:
        return
    name, args, _ = keras_arguments(config.optimizer)
    for key, value in args.items():
        if isinstance(value, float):
            assert math.isfinite(value) and value >= 0 and np.float32(value) < np.inf, (key, value)
    for beta in ("beta_1", "beta_2"):
        if beta in args:
            assert 0 <= args[beta] < 1
    optimizer = kmp.wrap(config=config, precision="float32")
    assert type(optimizer).__name__ in (name, f"MomentumCycled{name}")


@fuzz(400)
@example({"type": "WarmupDecayLR", "params": {"total_num_steps": 1, "warmup_num_steps": 1}})
@example({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e39}})
@given(_block(list(SCHEDULERS), PARAMETERS))
def test_scheduler_blocks(block):
    config = _ends_well(lambda: kmp.load_config({"optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                                                 "scheduler": block}))
    if config is None:
        return
    optimizer = kmp.wrap(config=config, precision="float32")
    schedule = optimizer._learning_rate
    steps = (0, 1, 2, 10, 1000, 10**6)
    # float32 arithmetic: within a few float32 ulps of the schedule's peak (as tests/test_schedules.py)
    peak = max(schedule.schedule.lr_at(k) for k in steps + schedule.schedule.milestones())
    for step in steps:
        python = schedule.schedule.lr_at(step)
        assert math.isfinite(python) and python >= 0, (step, python)
        keras_value = float(schedule(step))
        assert math.isfinite(keras_value) and keras_value >= 0
        assert abs(keras_value - python) <= 2.0**-20 * peak + 1e-12, (step, python, keras_value)
        if schedule.schedule.cycles_momentum:
            assert 0 <= schedule.schedule.momentum_at(step) <= 1


FILL_VALUES = [None, 0, 1, 8, 100, 1000, -1, 2.5, True, "8", 10**20, np.int64(4), 16, 32]


@fuzz(300)
@given(micro=st.sampled_from(FILL_VALUES), total=st.sampled_from(FILL_VALUES), warmup=st.sampled_from(FILL_VALUES),
       lr=st.sampled_from([None, 1e-3, 3e-5, 0.1, 0, -1e-3, math.nan, "x"]), precision=st.sampled_from([None, "fp16", "bf16",
                                                                                          "fp32", "half", 16]))
def test_auto_fills(micro, total, warmup, lr, precision):
    raw = {"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                             "warmup_max_lr": "auto"}}}
    fills = {k: v for k, v in (("micro_batch_size", micro), ("total_steps", total), ("warmup_steps", warmup),
                               ("learning_rate", lr), ("precision", precision)) if v is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = _ends_well(lambda: kmp.load_config(raw, **fills))
    if config is None:
        return
    assert config.micro_batch_size == micro and config.optimizer.params["lr"] == lr
    # Only the fp16 block is "auto" here: precision bf16 turns fp16 off, and nothing turns bf16 on (as HF).
    assert config.precision == ("fp16" if precision == "fp16" else "fp32")
    assert config.scheduler["params"]["total_num_steps"] == total
