"""Every Keras and TensorFlow internal kmp touches still exists and behaves.

kmp pins Keras 3.15 / TensorFlow 2.21 because it subclasses Keras's
LossScaleOptimizer and uses private parts of both. kmp/seams.py lists them
all (MODULE_SEAMS, ATTRIBUTE_SEAMS); this file checks every entry, so an
upgrade that moves one fails here first, naming it, instead of training
silently going wrong. It also checks that a moved seam breaks only the
feature that needs it.
"""

import ast
import functools
import hashlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TFEpochIterator

import kmp
from kmp import seams
from kmp.engine import fused
from kmp.engine.buffers import _queued, _read_all
from kmp.errors import KmpError


def test_pinned_versions():
    assert keras.__version__.startswith("3.15."), keras.__version__
    assert tf.__version__.startswith("2.21."), tf.__version__


# --- The tables -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(seams.MODULE_SEAMS))
def test_every_module_seam_resolves(name):
    assert callable(seams.get(name))


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _built(kind, **kwargs):
    opt = kind(0.1, **kwargs)
    opt.build([keras.Variable([1.0, 2.0], name="w")])
    return opt


def _objects(strategy):
    """One real object of each kind ATTRIBUTE_SEAMS names."""
    with strategy.scope():
        mirrored = tf.Variable(1.0)
    contexts = []
    strategy.run(lambda: contexts.append(tf.distribute.get_replica_context()))
    # MultiWorkerMirroredStrategy's cross-device ops, made as it makes them (a strategy of that kind
    # would configure this process's collectives: tests/test_multiworker.py runs one for real).
    from tensorflow.python.distribute import collective_util, cross_device_ops
    from tensorflow.python.framework import op_def_registry
    collective = cross_device_ops.CollectiveAllReduce(["/cpu:0", "/cpu:1"], 2, collective_util.Options())
    pipelines = [tf.data.Dataset.range(4).batch(2).unbatch(), tf.data.Dataset.range(4).ragged_batch(2)]
    return {
        # Its extended is a MirroredExtended: the attribute is set there.
        "tf.distribute MultiWorkerMirroredStrategy's extended": [strategy.extended],
        "tf.distribute CollectiveAllReduce (those cross-device ops)": [collective],
        "tf.distribute CollectiveReplicaLauncher": collective._launchers,
        "tf.distribute ReplicaContext": contexts,
        "keras.Model (TensorFlow trainer)": [_model()],
        "keras.layers.Layer": [keras.layers.Dense(1), _model()],
        "keras.optimizers.Optimizer": [_built(keras.optimizers.Adam), _built(keras.optimizers.AdamW)],
        "keras.optimizers.Optimizer(gradient_accumulation_steps=N)": [
            _built(keras.optimizers.SGD, gradient_accumulation_steps=2)],
        "keras.optimizers.Adagrad": [_built(keras.optimizers.Adagrad)],
        "keras.optimizers.Lion": [_built(keras.optimizers.Lion)],
        "keras.optimizers.Lamb": [_built(keras.optimizers.Lamb)],
        "keras TFOptimizer": [keras.optimizers.SGD()],
        "keras TFEpochIterator": [TFEpochIterator(tf.distribute.get_strategy(), x=np.zeros((4, 1)), batch_size=2)],
        "tf.distribute DistributedDataset": [strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))],
        "tf.experimental.Optional": [tf.experimental.Optional.from_value(1)],
        "keras.Variable (TensorFlow backend)": [keras.Variable([1.0, 2.0])],
        "tf.distribute DistributedVariable": [mirrored],
        "tf.distribute MirroredStrategy's extended (MultiWorkerMirrored's too)": [strategy.extended],
        "tf.data.Dataset": [tf.data.Dataset.range(4), tf.data.Dataset.range(4).batch(2).prefetch(1)],
        # The type names met walking those pipelines, as attributes.
        "type names in a tf.data pipeline": [types.SimpleNamespace(**{
            type(node).__name__: type(node) for pipeline in pipelines for node in _pipeline(pipeline)})],
        # The ops TensorFlow has registered by those names, as attributes.
        "TensorFlow's registered ops": [types.SimpleNamespace(**{
            name: op for name in seams.ATTRIBUTE_SEAMS["TensorFlow's registered ops"]
            if (op := op_def_registry.get(name)) is not None})],
        "tf.__internal__.distribute": [tf.__internal__.distribute],
        "tf.__internal__.tracking": [tf.__internal__.tracking],
    }


def _pipeline(dataset):
    pending, seen = [dataset], []
    while pending:
        seen.append(pending.pop())
        pending.extend(seen[-1]._inputs())
    return seen


def test_every_attribute_seam_exists_on_a_real_object(two_replicas):
    objects = _objects(two_replicas)
    assert set(objects) == set(seams.ATTRIBUTE_SEAMS)
    missing = [
        f"{kind}.{name}"
        for kind, names in seams.ATTRIBUTE_SEAMS.items()
        for obj in objects[kind]
        for name in names
        if not hasattr(obj, name)
    ]
    assert not missing, f"Keras/TensorFlow moved: {missing}"


def test_optional_element_spec_can_be_set_as_prepare_does():
    # kmp.prepare's multi-step loop starts from an empty Optional and gives it
    # the spec of the first step's outputs once traced.
    empty = tf.experimental.Optional.empty(None)
    full = tf.experimental.Optional.from_value(tf.constant([1.0]))
    empty._element_spec = full.element_spec
    assert empty.element_spec == full.element_spec


# --- Nothing private outside the tables -------------------------------------
#
# kmp's source, read with `ast`: every name with one leading underscore that
# kmp reads or writes as an attribute (`x._name`, or the string "_name", as
# getattr and the slot tables take it) and does not define itself must be in
# the tables above. kmp defines a name with a def or class, at module or
# class level, or as `self._name = ...` in a method of its own class. What kmp
# puts on others' objects is named `_kmp...` (kmp.engine.state).

KMP_DIR = Path(__file__).resolve().parent.parent / "kmp"
_PRIVATE = re.compile(r"_[A-Za-z]\w*")
# Private names of Python itself, not of Keras or TensorFlow.
_PYTHON = {"_getframe"}  # sys._getframe: kmp.scaling.optimizer finds the model that holds the optimizer
_SEAM_MODULES = ("keras.src", "tensorflow.python")


class _Names(ast.NodeVisitor):
    """The private names a kmp module defines, and those it uses, where ("kmp/x.py:12")."""

    def __init__(self, path: str):
        self.path, self.scopes = path, []
        self.defined, self.used, self.internal, self.imports = set(), [], [], []
        self.mentioned = set()  # every attribute and identifier-like string, private or not

    def _where(self, node) -> str:
        return f"{self.path}:{node.lineno}"

    def _scope(self, node, kind):
        self.defined.add(node.name)
        self.scopes.append(kind)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_ClassDef(self, node):
        self._scope(node, "class")

    def visit_FunctionDef(self, node):
        self._scope(node, "method" if self.scopes[-1:] == ["class"] else "function")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store) and self.scopes[-1:] in ([], ["class"]):
            self.defined.add(node.id)

    def visit_Attribute(self, node):
        self.mentioned.add(node.attr)
        if _PRIVATE.fullmatch(node.attr):
            own = (isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                   and node.value.id in ("self", "cls") and "method" in self.scopes)
            if own:
                self.defined.add(node.attr)
            else:
                self.used.append((node.attr, self._where(node)))
        # tf.__internal__.<module>.<name>
        if isinstance(node.value, ast.Attribute) and getattr(node.value.value, "attr", None) == "__internal__":
            self.internal.append((f"tf.__internal__.{node.value.attr}", node.attr, self._where(node)))
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and node.value.isidentifier():
            self.mentioned.add(node.value)
        if isinstance(node.value, str) and _PRIVATE.fullmatch(node.value):
            self.used.append((node.value, self._where(node)))

    def visit_JoinedStr(self, node):
        # An f-string's literal pieces ("_scale" in f"{name}_scale") name nothing; its expressions may.
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                self.visit(value)

    def visit_alias(self, node):
        self.defined.add(node.asname or node.name.split(".")[0])

    def visit_Import(self, node):
        self.imports += [(alias.name, self._where(node)) for alias in node.names]
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        self.imports.append((node.module or "", self._where(node)))
        self.generic_visit(node)


@functools.cache
def _kmp_names() -> _Names:
    """All of kmp's modules but kmp/seams.py (the tables) in one _Names."""
    names = _Names("")
    for path in sorted(KMP_DIR.rglob("*.py")):
        if path == KMP_DIR / "seams.py":
            continue
        names.path = str(path.relative_to(KMP_DIR.parent))
        names.visit(ast.parse(path.read_text()))
    return names


def _untabled() -> list[str]:
    """Where kmp uses a private name that is neither its own nor in kmp/seams.py's tables."""
    names = _kmp_names()
    tabled = {name for kind in seams.ATTRIBUTE_SEAMS.values() for name in kind}
    tabled |= {attribute for _, attribute, _ in seams.MODULE_SEAMS.values()}
    return [f"{where}: {name}" for name, where in names.used
            if name not in names.defined | tabled | _PYTHON and not name.startswith("_kmp")]


def test_the_scan_sees_kmps_private_names():
    # A scan that found nothing would pass the tests below.
    names = _kmp_names()
    used = {name for name, _ in names.used}
    assert {"_learning_rate", "_iterations", "_momentums", "_maybe_symbolic_build", "_inputs"} <= used
    assert {"_Adam", "_REPLACEMENTS", "_moment_codes", "_falling_back"} <= names.defined
    assert "_jit_compile" not in names.defined  # set on the model by a function, not on kmp's own object


def test_every_private_name_kmp_uses_is_in_the_tables():
    untabled = _untabled()
    assert not untabled, (
        "kmp uses private Keras/TensorFlow names that kmp/seams.py does not list: " + "; ".join(untabled)
        + ". Add each to kmp/seams.py ATTRIBUTE_SEAMS, under the kind of object that has it (and an object "
        "of that kind to _objects in tests/test_keras_seams.py), so an upgrade that moves it fails here.")


def test_an_untabled_name_is_found(monkeypatch):
    kind = "tf.distribute MirroredStrategy's extended (MultiWorkerMirrored's too)"
    monkeypatch.setitem(seams.ATTRIBUTE_SEAMS, kind,
                        tuple(n for n in seams.ATTRIBUTE_SEAMS[kind] if n != "_use_merge_call"))
    found = _untabled()
    assert len(found) == 1 and re.fullmatch(r"kmp/distribute/communication\.py:\d+: _use_merge_call", found[0])


def test_every_attribute_seam_is_still_used():
    # A table that kept names kmp no longer uses would be checked for nothing.
    unused = {name for kind in seams.ATTRIBUTE_SEAMS.values() for name in kind} - _kmp_names().mentioned
    assert not unused, f"{sorted(unused)}: kmp no longer uses them; remove them from kmp/seams.py ATTRIBUTE_SEAMS"


def test_tf_internal_names_kmp_uses_are_in_the_tables():
    untabled = [f"{where}: {kind}.{name}" for kind, name, where in _kmp_names().internal
                if name not in seams.ATTRIBUTE_SEAMS.get(kind, ())]
    assert _kmp_names().internal and not untabled, (
        f"{untabled}: add each to kmp/seams.py ATTRIBUTE_SEAMS under its tf.__internal__ module")


def test_only_kmp_seams_imports_private_modules():
    found = [f"{where}: {module}" for module, where in _kmp_names().imports if module.startswith(_SEAM_MODULES)]
    assert not found, f"{found}: import private modules through kmp/seams.py MODULE_SEAMS and seams.get(name)"


# --- How kmp uses them ------------------------------------------------------


def test_import_kmp_resolves_no_seam():
    code = "import kmp, kmp.seams; print(sorted(kmp.seams.resolved()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"TF_CPP_MIN_LOG_LEVEL": "3", **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_moved_seam_breaks_only_the_feature_that_needs_it(monkeypatch):
    monkeypatch.setitem(seams.MODULE_SEAMS, "TensorFlowTrainer",
                        ("keras.src.moved_away", "TensorFlowTrainer", "kmp.prepare: a test"))
    monkeypatch.setattr(seams, "_resolved", {})
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    model = _model()
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1), precision="mixed_float16"), loss="mse")
    model.fit(x, y, verbose=0)  # wrap and kmp's optimizer need no trainer internals
    prepared = kmp.prepare(_model())
    with pytest.raises(KmpError, match="keras.src.moved_away.TensorFlowTrainer"):
        prepared.fit(x, y, verbose=0)


def test_missing_optimizer_internals_make_fused_fall_back(monkeypatch, caplog):
    monkeypatch.setattr(fused, "_INTERNALS", fused._INTERNALS + ("_moved_in_a_later_keras",))
    opt = keras.optimizers.Adam(0.1)
    assert "_moved_in_a_later_keras" in fused.fused_support(opt)
    variable = keras.Variable([1.0, 2.0])
    reference = keras.Variable([1.0, 2.0])
    fused.fused_apply(opt, [tf.constant([0.5, -0.5])], [variable])
    keras.optimizers.Adam(0.1).apply([tf.constant([0.5, -0.5])], [reference])
    np.testing.assert_array_equal(variable.numpy(), reference.numpy())


def test_inner_optimizer_reduction_hook():
    # kmp all-reduces once and shadows this on its inner optimizer for one call.
    tf_optimizer = seams.get("TFOptimizer")
    hook = tf_optimizer._all_reduce_sum_gradients
    assert list(inspect.signature(hook).parameters) == ["self", "grads_and_vars"]
    assert "self._all_reduce_sum_gradients(" in inspect.getsource(tf_optimizer._backend_update_step)


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


def test_public_routes_kmp_takes_are_the_same_objects():
    # Where Keras/TF export a seam publicly, kmp uses the export.
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.trainers.data_adapters import data_adapter_utils

    assert keras.StatelessScope is StatelessScope
    assert {"state_mapping", "collect_losses"} <= set(inspect.signature(StatelessScope).parameters)
    with keras.StatelessScope(state_mapping=[(keras.Variable(1.0), tf.constant(2.0))]) as scope:
        assert isinstance(scope.state_mapping, dict) and callable(scope.get_current_value)
    assert keras.utils.unpack_x_y_sample_weight is data_adapter_utils.unpack_x_y_sample_weight
    assert callable(tf.__internal__.distribute.interim.maybe_merge_call)


def test_trainer_internals_the_replica_step_and_prepare_use():
    """kmp.engine.replica_step rebuilds Keras's train_step from these parts; prepare swaps two methods."""
    trainer = seams.get("TensorFlowTrainer")
    source = inspect.getsource(trainer.train_step)
    for part in ("self.optimizer.scale_loss(loss)", "self.optimizer.apply_gradients(", "self._compute_loss(",
                 "self._loss_tracker.update_state(", "unscale_loss_for_distribution(", "self.compute_metrics(",
                 "self._call_has_training_arg"):
        assert part in source, part
    assert "self.jit_compile" in inspect.getsource(trainer._make_function)
    assert "self._make_function(self.train_step)" in inspect.getsource(trainer.make_train_function)
    assert list(inspect.signature(trainer._maybe_symbolic_build).parameters) == ["self", "iterator", "data_batch"]
    assert list(inspect.signature(trainer._make_function).parameters) == ["self", "step_function"]
    build = inspect.getsource(trainer._maybe_symbolic_build)
    assert "if iterator is not None:" in build and "self._symbolic_build(data_batch=data_batch)" in build
    reduce = seams.get("reduce_per_replica")
    assert 'strategy.reduce("MEAN", v, axis=0)' in inspect.getsource(reduce)
    assert list(inspect.signature(reduce).parameters) == ["values", "strategy", "reduction"]
    # kmp's multi-step loop wraps its step as Keras wraps one_step_on_data.
    assert list(inspect.signature(trainer._autoconvert_optionals).parameters) == ["self", "step_func"]
    assert "self._autoconvert_optionals(one_step_on_data)" in inspect.getsource(trainer._make_function)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model._jit_compile is None or isinstance(model._jit_compile, (bool, str))


def test_a_layer_calls_the_call_on_its_instance():
    """kmp.engine.overflow_layer wraps `call` (or `quantized_call`) in a layer's __dict__ for one forward pass."""
    operation = inspect.getsource(keras.Operation.__call__)
    assert "call_fn = self.call" in operation and "call_fn = self.quantized_call" in operation
    layer = keras.layers.Dense(2)
    layer.build((None, 2))
    seen = []
    original = layer.call
    layer.__dict__["call"] = lambda *args, **kwargs: seen.append(args) or original(*args, **kwargs)
    layer(np.ones((1, 2), "float32"))
    del layer.__dict__["call"]
    layer(np.ones((1, 2), "float32"))
    assert len(seen) == 1
    children = _model()._flatten_layers(include_self=False, recursive=False)
    assert [type(c).__name__ for c in children if type(c).__name__ != "InputLayer"] == ["Dense"]  # direct children
    assert list(inspect.signature(seams.get("TensorFlowTrainer")._symbolic_build).parameters) == [
        "self", "iterator", "data_batch"]


def test_optimizer_internals_the_fused_update_reads():
    """kmp.engine.fused reads Keras's optimizer state directly and redoes its update_step."""
    for kind in (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW):
        opt = kind(0.1, momentum=0.5) if kind is keras.optimizers.SGD else kind(0.1)
        variable = keras.Variable([1.0, 2.0], name="w")
        opt.build([variable])
        assert fused.fused_support(opt) is None
        assert opt._learning_rate is not None and opt._iterations is opt.iterations
        assert opt._get_variable_index(variable) == 0
        assert opt._var_key(variable) in opt._trainable_variables_indices
        assert isinstance(opt._use_weight_decay(variable), bool)
        if kind is keras.optimizers.SGD:
            assert len(opt.momentums) == 1
        else:
            assert len(opt._momentums) == len(opt._velocities) == 1
    opt = keras.optimizers.AdamW(0.01)
    opt.exclude_from_weight_decay(var_names=["bias"])
    variables = [keras.Variable(np.ones(3, "float32"), name=n) for n in ("kernel", "bias", "other")]
    opt.build(variables)
    assert [opt._use_weight_decay(v) for v in variables] == [True, False, True]


# kmp redoes these Keras functions op for op (kmp/engine/fused.py, kmp/scaling/gradients.py).
# Fingerprints of their source (whitespace ignored): when one changes,
# re-check kmp against it (tests/test_fused.py's parity tests show how far
# apart they are), then update the fingerprint here.
def _keras_private(module, name):
    import importlib

    return getattr(importlib.import_module(module), name)


UPDATE_RULES = {
    "SGD.update_step": (lambda: keras.optimizers.SGD.update_step, "1fa1856e20146af0"),
    "Adam.update_step": (lambda: keras.optimizers.Adam.update_step, "878399c78327be7a"),
    "AdamW.update_step": (lambda: keras.optimizers.AdamW.update_step, "878399c78327be7a"),
    "TFOptimizer._apply_weight_decay": (lambda: seams.get("TFOptimizer")._apply_weight_decay, "73a2702187683640"),
    "BaseOptimizer._clip_gradients": (lambda: keras.optimizers.Optimizer._clip_gradients, "3461e882ec4efad2"),
    "clip_by_global_norm": (
        lambda: _keras_private("keras.src.optimizers.base_optimizer", "clip_by_global_norm"), None),
    "global_norm": (lambda: _keras_private("keras.src.optimizers.base_optimizer", "global_norm"), None),
}


def _fingerprint(function):
    return hashlib.sha256("".join(inspect.getsource(function).split()).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(UPDATE_RULES))
def test_update_rules_kmp_mirrors_are_unchanged(name):
    function, fingerprint = UPDATE_RULES[name]
    if fingerprint is None:  # kmp.scaling.gradients has the same source, bar names
        return
    assert _fingerprint(function()) == fingerprint, f"Keras changed {name}: re-check kmp/engine/fused.py against it"


def test_kmp_global_norm_clip_equals_keras_bit_for_bit():
    from kmp.scaling import gradients

    keras_clip = _keras_private("keras.src.optimizers.base_optimizer", "clip_by_global_norm")
    grads = [tf.constant(np.linspace(-3, 5, 7, dtype="float32")), tf.constant([[1e3, -2e-3]], "float32")]
    for clip in (0.5, 1e6):
        for ours, theirs in zip(gradients.clip_by_global_norm(grads, clip), keras_clip(grads, clip)):
            np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    inf = [tf.constant([np.inf, 1.0], "float32")]
    assert np.isnan(gradients.clip_by_global_norm(inf, 1.0)[0].numpy()).all()


def _address(tensor):
    view = np.asarray(tensor)
    assert not view.flags.owndata  # numpy's view of a host tensor: its buffer, not a copy
    return view.__array_interface__["data"][0]


def _sgd(variable):
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return lambda: optimizer.apply([tf.ones((4, 3))], [variable])


def _adam_in_xla(variable):
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([variable])
    return tf.function(lambda: optimizer.apply([tf.ones((4, 3))], [variable]), jit_compile=True)


def _set_weights(layer):
    return lambda: layer.set_weights([np.full((4, 3), 7.0, "float32"), np.zeros(3, "float32")])


# route -> (the layer's kernel -> a write of it)
_WRITES = {
    "assign": lambda v: lambda: v.assign(v * 2.0),
    "assign_add": lambda v: lambda: v.assign_add(tf.ones_like(v)),
    "assign_sub": lambda v: lambda: v.assign_sub(tf.ones_like(v)),
    "scatter_nd_update": lambda v: lambda: v.value.scatter_nd_update([[0, 0]], [5.0]),
    "scatter_update": lambda v: lambda: v.value.scatter_update(tf.IndexedSlices(tf.ones((1, 3)), [1])),
    "a tf.function": lambda v: tf.function(lambda: v.value.assign_add(tf.ones((4, 3)))),
    "an XLA tf.function": lambda v: tf.function(lambda: v.value.assign_sub(tf.ones((4, 3))), jit_compile=True),
    "Keras's SGD": _sgd,
    "Keras's Adam in XLA": _adam_in_xla,
}


@pytest.mark.parametrize("route", sorted(_WRITES) + ["set_weights"])
def test_a_variable_written_while_its_value_is_held_moves_to_a_new_buffer(route):
    """kmp.engine.buffers.written_since_store: TensorFlow's copy-on-write. A variable whose buffer a
    tensor still holds is written into a new buffer, by every route; unheld, a write can be in place
    (so an address that stays says nothing was written only while the value is held)."""
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    variable = layer.kernel
    write = _set_weights(layer) if route == "set_weights" else _WRITES[route](variable)
    write()  # slots and functions made: the next write is like any later one
    held = tf.raw_ops.ReadVariableOp(resource=variable.value.handle, dtype=tf.float32)
    copy = np.asarray(held).copy()
    address = _address(held)

    def read_addresses():  # by ReadVariableOp, and by _ReadVariablesOp as the check reads (_read_all)
        return {_address(variable.value.read_value()), _address(_read_all([variable.value])[0])}
    if route.startswith("scatter"):
        # A variable written sparsely is read as a copy from then on: never the same address twice.
        assert address not in read_addresses()
    else:
        assert read_addresses() == {address}  # a read shares the buffer
    write()
    assert address not in read_addresses()
    np.testing.assert_array_equal(held, copy)  # what was held did not change
    if route in ("a tf.function", "an XLA tf.function"):
        del held
        address = _address(variable.value.read_value())
        write()
        assert _address(variable.value.read_value()) == address  # unheld: in place


def test_many_variables_read_by_one_op_as_each_by_its_own(two_replicas):
    """kmp.engine.buffers._read_all: TensorFlow's _ReadVariablesOp, one op per device, gives each
    variable's value as ReadVariableOp does, in the buffer the variable holds, on both logical CPUs and
    for every dtype; a traced read takes each variable's value()."""
    with two_replicas.scope():
        mirrored = [tf.Variable(tf.fill([64], float(k))) for k in range(3)]
    components = [c for v in mirrored for c in two_replicas.experimental_local_results(v)]
    plain = [tf.Variable(np.arange(6, dtype=dtype).reshape(2, 3)) for dtype in ("float32", "float16", "uint8")]
    variables = components + plain
    values = _read_all(variables)
    assert [v.device for v in values] == [v.device for v in variables]
    for variable, value in zip(variables, values):
        one = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
        assert value.dtype == variable.dtype and _address(value) == _address(one)
        np.testing.assert_array_equal(value, one)
    traced = tf.function(lambda: _read_all(plain))()
    for variable, value in zip(plain, traced):
        np.testing.assert_array_equal(value, variable.numpy())


def test_queued_ops_have_run_when_the_queue_is_left_and_an_error_does_not_stay():
    """kmp.engine.buffers._queued: the copies' eager ops on an executor thread of their own. Leaving it,
    every op has run (a read on the default executor sees the writes); an op's error is raised there,
    and the next use of the queue works."""
    variables = [tf.Variable(tf.zeros([64, 64])) for _ in range(50)]
    with _queued():
        for k, variable in enumerate(variables):
            variable.assign(tf.fill([64, 64], float(k)))
    assert [float(v.numpy()[0, 0]) for v in variables] == [float(k) for k in range(50)]
    with pytest.raises(tf.errors.InvalidArgumentError):
        with _queued():
            tf.raw_ops.AssignVariableOp(resource=variables[0].handle, value=tf.zeros([3]), validate_shape=True)
    with _queued():
        variables[1].assign(tf.ones([64, 64]))
    assert float(variables[1].numpy().sum()) == 64 * 64


def test_ops_already_asynchronous_stay_on_their_executor(monkeypatch):
    """Where eager ops already run asynchronously (tf.config.experimental.set_synchronous_execution(False)),
    kmp.engine.buffers._queued keeps them on that executor, in order with what was queued there before."""
    context, executor = seams.get("eager_context")(), seams.get("new_executor")(enable_async=True)
    with seams.get("executor_scope")(executor):
        monkeypatch.setitem(seams._resolved, "executor_scope", lambda _: pytest.fail("a second executor"))
        variable = tf.Variable(0.0)
        variable.assign(3.0)  # queued on the caller's executor
        with _queued():
            assert context.is_async()
            doubled = variable.read_value() * 2.0
        executor.wait()
    assert float(doubled) == 6.0
