"""The Keras and TensorFlow internals kmp relies on still exist and behave.

kmp pins Keras 3.15 / TensorFlow 2.21 because kmp.LossScaleOptimizer
subclasses Keras's class and uses a few private hooks. When an upgrade moves
one of them, this file fails first, naming the hook, instead of training
silently going wrong.
"""

import hashlib
import inspect

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.ops import control_flow_util


def test_pinned_versions():
    assert keras.__version__.startswith("3.15."), keras.__version__
    assert tf.__version__.startswith("2.21."), tf.__version__


def test_inner_optimizer_reduction_hook_exists():
    # kmp all-reduces once and replaces this on its inner optimizer only.
    hook = tf_optimizer.TFOptimizer._all_reduce_sum_gradients
    assert list(inspect.signature(hook).parameters) == ["self", "grads_and_vars"]
    source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in source


@pytest.mark.parametrize(
    "name",
    ["build", "apply", "scale_loss", "get_config", "from_config", "_overwrite_variable_with_gradient"],
)
def test_keras_loss_scale_optimizer_methods_kmp_overrides_or_uses(name):
    assert callable(getattr(keras.optimizers.LossScaleOptimizer, name))


def test_keras_loss_scale_optimizer_state_names():
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build([keras.Variable(1.0)])
    assert opt.dynamic_scale.dtype == "float32"
    assert opt.step_counter is not None
    assert opt.iterations is opt.inner_optimizer.iterations


def test_trainer_scales_the_loss_and_applies_through_the_optimizer():
    source = inspect.getsource(tf_trainer.TensorFlowTrainer.train_step)
    assert "self.optimizer.scale_loss(loss)" in source
    assert "self.optimizer.apply_gradients(" in source


def test_distribution_internals():
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)
    assert callable(control_flow_util.GraphOrParentsInXlaContext)
    from keras.src.utils import tracking

    assert callable(tracking.no_automatic_dependency_tracking)


def test_optimizer_internals_the_fused_update_reads():
    """kmp.fused reads Keras's optimizer state directly and redoes its update_step."""
    from keras.src.optimizers import base_optimizer

    for kind in (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW):
        opt = kind(0.1, momentum=0.5) if kind is keras.optimizers.SGD else kind(0.1)
        variable = keras.Variable([1.0, 2.0], name="w")
        opt.build([variable])
        assert opt._learning_rate is not None and opt._iterations is opt.iterations
        assert opt._get_variable_index(variable) == 0
        assert opt._var_key(variable) in opt._trainable_variables_indices
        assert isinstance(opt._use_weight_decay(variable), bool)
        assert callable(opt._filter_empty_gradients)
        if kind is keras.optimizers.SGD:
            assert len(opt.momentums) == 1
        else:
            assert len(opt._momentums) == len(opt._velocities) == 1
    assert callable(base_optimizer.clip_by_global_norm) and callable(base_optimizer.global_norm)
    from tensorflow.python.distribute import values as tf_values

    assert callable(tf_values.DistributedVariable._get_on_device_or_primary)


# kmp/fused.py redoes these Keras functions op for op. Fingerprints of their
# source (whitespace ignored): when one changes, re-check fused.py against it
# (tests/test_fused.py's parity tests show how far apart they are), then
# update the fingerprint here.
UPDATE_RULES = {
    "SGD.update_step": (keras.optimizers.SGD.update_step, "1fa1856e20146af0"),
    "Adam.update_step": (keras.optimizers.Adam.update_step, "878399c78327be7a"),
    "AdamW.update_step": (keras.optimizers.AdamW.update_step, "878399c78327be7a"),
    "TFOptimizer._apply_weight_decay": (tf_optimizer.TFOptimizer._apply_weight_decay, "73a2702187683640"),
    "BaseOptimizer._clip_gradients": (keras.optimizers.Optimizer._clip_gradients, "3461e882ec4efad2"),
}


@pytest.mark.parametrize("name", sorted(UPDATE_RULES))
def test_update_rules_fused_mirrors_are_unchanged(name):
    function, fingerprint = UPDATE_RULES[name]
    digest = hashlib.sha256("".join(inspect.getsource(function).split()).encode()).hexdigest()[:16]
    assert digest == fingerprint, f"Keras changed {name}: re-check kmp/fused.py against it"


def test_trainer_internals_the_replica_step_and_prepare_use():
    """kmp.replica_step rebuilds Keras's train_step from these parts; prepare swaps two methods."""
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import trainer as base_trainer
    from keras.src.trainers.data_adapters import data_adapter_utils

    source = inspect.getsource(tf_trainer.TensorFlowTrainer.train_step)
    for part in ("self._compute_loss(", "self._loss_tracker.update_state(", "unscale_loss_for_distribution(",
                 "self.compute_metrics(", "self._call_has_training_arg"):
        assert part in source, part
    assert "self.jit_compile" in inspect.getsource(tf_trainer.TensorFlowTrainer._make_function)
    assert "self._make_function(self.train_step)" in inspect.getsource(tf_trainer.TensorFlowTrainer.make_train_function)
    assert callable(loss_module.unscale_loss_for_distribution)
    assert callable(data_adapter_utils.unpack_x_y_sample_weight)
    assert callable(base_trainer.model_supports_jit)
    assert {"state_mapping", "collect_losses"} <= set(inspect.signature(StatelessScope).parameters)
    with StatelessScope(state_mapping=[(keras.Variable(1.0), tf.constant(2.0))]) as scope:
        assert isinstance(scope.state_mapping, dict) and callable(scope.get_current_value)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model._jit_compile is None or isinstance(model._jit_compile, (bool, str))
