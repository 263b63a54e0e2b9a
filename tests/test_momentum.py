"""kmp.schedules.momentum: OneCycle's momentum cycling drives Adam-family beta_1 per applied update, as
DeepSpeed's betas."""

import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp.schedules.momentum import MomentumCycledAdam
from kmp.schedules.formulas import parse_scheduler

ONE_CYCLE = {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                                             "cycle_min_mom": 0.8, "cycle_max_mom": 0.95}}


def _wrap(optimizer_block, scheduler=ONE_CYCLE):
    keras.config.set_dtype_policy("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kmp.wrap(config={"optimizer": optimizer_block, "scheduler": scheduler})


def test_adam_steps_with_the_scheduled_beta_1_and_beta_2_099():
    optimizer = _wrap({"type": "Adam", "params": {"lr": 0.01}})
    assert type(optimizer) is MomentumCycledAdam and optimizer.beta_2 == 0.99
    schedule = parse_scheduler(ONE_CYCLE, base_lr=0.01)
    w = keras.Variable(np.ones(3, "float32"))
    grads = [np.array([0.5, -1.0, 2.0], "float32") * (k + 1) for k in range(5)]
    # Adam's update (Keras's form) with this step's beta_1 and lr, as DeepSpeed sets betas/lr before each step.
    ref, m, v = np.ones(3), np.zeros(3), np.zeros(3)
    for k, g in enumerate(grads):
        optimizer.apply([g], [w])
        b1, lr, t = schedule.momentum_at(k), schedule.lr_at(k), k + 1
        m, v = m + (g - m) * (1 - b1), v + (g * g - v) * (1 - 0.99)
        ref = ref - lr * np.sqrt(1 - 0.99**t) / (1 - b1**t) * m / (np.sqrt(v) + 1e-8)
        np.testing.assert_allclose(w.numpy(), ref, rtol=2e-6, atol=1e-7)
    assert len({schedule.momentum_at(k) for k in range(5)}) > 1  # the momentum did move


def test_the_copy_round_trips_and_the_schedule_is_saved(tmp_path):
    optimizer = _wrap({"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}})
    again = type(optimizer).from_config(optimizer.get_config())
    assert again.momentum_schedule.get_config() == optimizer.momentum_schedule.get_config()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer).__name__ == "MomentumCycledAdamW"


@pytest.mark.parametrize("block", [{"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                                   {"type": "Adagrad", "params": {"lr": 0.1}}])
def test_optimizers_without_betas_keep_their_momentum_with_a_warning(block):
    keras.config.set_dtype_policy("float32")
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        optimizer = kmp.wrap(config={"optimizer": block, "scheduler": ONE_CYCLE})
    assert type(optimizer).__module__.startswith("keras")
