"""Choosing a tf.distribute strategy, and preparing a Keras model for it.

- `resolve_strategy("auto")` picks what the machine and the cluster call for:

      if a TPU cluster resolver is found:        TPUStrategy
      elif TF_CONFIG names > 1 chief + worker:   MultiWorkerMirroredStrategy
      elif more than one GPU:                    MirroredStrategy
      else:                                      tf.distribute.get_strategy()

  Every detection input (`tf_config=`, `tpu=`, `gpus=`) can be given, so each
  branch is tested without the hardware. A config names the strategy under
  `"kmp": {"strategy": ...}` (`strategy_from_config`).
- `prepare(model)` lets `fit()`/`evaluate()` run under
  MultiWorkerMirroredStrategy, where Keras 3.15 fails twice on TensorFlow
  (keras-team/keras#20585): `_maybe_symbolic_build` all-reduces the first data
  batch only to learn its shapes ("Attempt to convert a value (PerReplica:...)
  to a Tensor", before the first step), and every step's logs are reduced
  with `axis=0`, which fails for scalars. Only the given instance changes.
- `tpu_settings(strategy, model)` gives what a TPU run should use: bfloat16,
  `steps_per_execution`, and the layers whose sizes the matrix unit pads. No
  TPU has run this code; its seams are unit-tested with fakes
  (docs/distributed.md).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as _keras_trainer

from kmp import replica_step
from kmp.config import STRATEGIES, Config, StrategyName
from kmp.deepspeed import load_config
from kmp.errors import Problem, check, did_you_mean
from kmp.precision import Hardware, Precision, check_hardware, resolve_precision

logger = logging.getLogger(__name__)


# TF_CONFIG task types that MultiWorkerMirroredStrategy knows ("ps" is
# ParameterServerStrategy's, which kmp does not choose).
_TASK_TYPES = ("chief", "worker", "evaluator")

# TPU matrix units multiply 128 x 128 tiles (v2-v5); other sizes are padded.
TPU_TILE = 128
# Steps per tf.function call on TPU. Each call is a host -> TPU round trip of
# a few milliseconds; a small model's step is shorter than that, so 32 steps a
# call spend most of the time computing, while callbacks and the progress bar
# still report often. Keras's and TensorFlow's TPU guides use 32-100.
TPU_STEPS_PER_EXECUTION = 32

TpuLike = Union[tf.distribute.cluster_resolver.ClusterResolver, Callable[[], Any], None]


# --------------------------------------------------------------------------
# Strategy resolution
# --------------------------------------------------------------------------


def resolve_strategy(
    choice: StrategyName | tf.distribute.Strategy | None = None,
    *,
    tf_config: Mapping[str, Any] | str | None = None,
    tpu: TpuLike = None,
    gpus: list | None = None,
    communication_options: tf.distribute.experimental.CommunicationOptions | None = None,
) -> tf.distribute.Strategy:
    """The strategy for `choice` ("auto" when None); a Strategy instance is returned as is.

    Args:
        choice: one of "auto", "default", "mirrored", "multi_worker_mirrored",
            "tpu", or a `tf.distribute.Strategy`.
        tf_config: the cluster, as the TF_CONFIG variable holds it (a dict or
            its JSON). None reads the TF_CONFIG environment variable.
        tpu: a TPU cluster resolver, or a callable returning one or None.
            None looks for a TPU (TPU_NAME, a local TPU device).
        gpus: the GPUs to count. None lists the physical GPUs.
        communication_options: passed to MultiWorkerMirroredStrategy, e.g.
            `CommunicationOptions(timeout_seconds=600)` so a collective whose
            peer died fails instead of waiting forever.

    Raises ConfigError for an unknown name, a malformed TF_CONFIG, or "tpu"
    without a TPU.
    """
    if isinstance(choice, tf.distribute.Strategy):
        return choice
    name = _checked_name("auto" if choice is None else choice, "strategy")
    cluster, from_env = None, True
    if name in ("auto", "multi_worker_mirrored"):
        cluster, from_env = _read_tf_config(tf_config)
    resolver = None
    if name in ("auto", "tpu"):
        resolver = tpu() if callable(tpu) and not _is_resolver(tpu) else tpu
        if resolver is None and tpu is None:
            resolver = _find_tpu()
        if name == "tpu" and resolver is None:
            check([Problem(
                "strategy", "a strategy whose hardware is here", "tpu",
                "No TPU was found: set TPU_NAME, run on a TPU VM, pass tpu=TPUClusterResolver(...), "
                "or choose 'auto'.",
            )], "kmp strategy")
    if name == "auto":
        name, why = _auto(resolver, cluster, gpus)
        logger.info("strategy='auto' -> %s: %s.", name, why)
    return _BUILDERS[name](
        resolver=resolver,
        cluster=None if from_env else cluster,
        communication_options=communication_options,
    )


def strategy_from_config(config, **detection) -> tf.distribute.Strategy:
    """The strategy a config names under `"kmp": {"strategy": ...}` ("auto" when absent).

    `config` is a `kmp.Config` or anything `kmp.load_config` reads; it is
    validated there. `detection` is passed to `resolve_strategy`.
    """
    settings = config if isinstance(config, Config) else load_config(config)
    return resolve_strategy(settings.strategy, **detection)


def _checked_name(value: Any, path: str, source: str = "kmp strategy") -> StrategyName:
    if isinstance(value, str) and value in STRATEGIES:
        return value
    hint = did_you_mean(value, STRATEGIES) if isinstance(value, str) else ""
    expected = f"one of {', '.join(map(repr, STRATEGIES))}"
    if path == "strategy":
        expected += " or a tf.distribute.Strategy"
    check([Problem(path, expected, value, hint)], source)


def _auto(resolver, cluster: Mapping[str, Any] | None, gpus: list | None) -> tuple[str, str]:
    if resolver is not None:
        return "tpu", "a TPU cluster resolver was found"
    workers = _worker_count(cluster)
    if workers > 1:
        return "multi_worker_mirrored", f"TF_CONFIG names {workers} workers (chief included)"
    gpus = tf.config.list_physical_devices("GPU") if gpus is None else gpus
    if len(gpus) > 1:
        return "mirrored", f"{len(gpus)} GPUs on this machine"
    return "default", "one device, no cluster"


def _worker_count(cluster: Mapping[str, Any] | None) -> int:
    if not cluster:
        return 0
    spec = cluster["cluster"]
    return len(spec.get("worker", [])) + len(spec.get("chief", []))


def _read_tf_config(tf_config) -> tuple[dict[str, Any] | None, bool]:
    """(parsed and checked TF_CONFIG or None, whether it came from the environment)."""
    from_env = tf_config is None
    path = "TF_CONFIG" if from_env else "tf_config"
    raw = os.environ.get("TF_CONFIG", "") if from_env else tf_config
    if isinstance(raw, str):
        if not raw.strip():
            return None, from_env
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            check([Problem(path, "JSON such as " + _TF_CONFIG_EXAMPLE, raw, f"It does not parse: {e}.")],
                  "TF_CONFIG")
    if not isinstance(raw, Mapping):
        check([Problem(path, "a JSON object such as " + _TF_CONFIG_EXAMPLE, raw)], "TF_CONFIG")
    if not raw:
        return None, from_env
    check(_tf_config_problems(raw, path), "TF_CONFIG")
    return dict(raw), from_env


_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}'
)


def _tf_config_problems(raw: Mapping[str, Any], path: str) -> list[Problem]:
    out: list[Problem] = []
    cluster, task = raw.get("cluster"), raw.get("task")
    if not isinstance(cluster, Mapping) or not cluster:
        out.append(Problem(f"{path}.cluster", 'an object such as {"worker": ["host:port", ...]}', cluster))
        cluster = {}
    for job, addresses in cluster.items():
        where = f"{path}.cluster.{job}"
        if job == "ps":
            out.append(Problem(where, "no parameter servers (kmp chooses only all-reduce strategies)",
                               addresses, "Create tf.distribute.ParameterServerStrategy yourself and "
                               "pass it as the strategy."))
        elif job not in _TASK_TYPES:
            out.append(Problem(where, f"a job named one of {', '.join(map(repr, _TASK_TYPES))}", addresses,
                               did_you_mean(str(job), _TASK_TYPES)))
        if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
            out.append(Problem(where, 'a list of "host:port" strings', addresses))
    if not isinstance(task, Mapping):
        out.append(Problem(f"{path}.task", 'an object such as {"type": "worker", "index": 0}', task))
        return out
    kind, index = task.get("type"), task.get("index")
    if kind not in cluster:
        names = ", ".join(map(repr, cluster)) or "none"
        out.append(Problem(f"{path}.task.type", f"a job of the cluster ({names})", kind))
    elif not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[kind] or []):
        count = len(cluster[kind]) if isinstance(cluster[kind], list) else 0
        out.append(Problem(f"{path}.task.index", f"an integer from 0 to {count - 1} "
                           f"(cluster.{kind} has {count} addresses)", index))
    return out


def _is_resolver(value) -> bool:
    return isinstance(value, tf.distribute.cluster_resolver.ClusterResolver)


def _find_tpu():
    """A TPUClusterResolver when a TPU is named or attached, else None.

    Constructing a resolver with no hint can query the GCE metadata server,
    which blocks where there is no network; kmp asks only when TPU_NAME (or a
    Colab/GKE TPU variable) is set or a TPU device is attached.
    """
    named = any(os.environ.get(k) for k in ("TPU_NAME", "COLAB_TPU_ADDR", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS"))
    local = not named and bool(tf.config.list_physical_devices("TPU"))
    if not (named or local):
        return None
    try:
        return tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local" if local else None)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        logger.info("No TPU: TPUClusterResolver failed (%s).", e)
        return None


def _build_default(**_):
    return tf.distribute.get_strategy()


def _build_mirrored(**_):
    return tf.distribute.MirroredStrategy()


def _build_multi_worker(cluster=None, communication_options=None, **_):
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=_cluster_resolver(cluster), communication_options=communication_options
    )


def _cluster_resolver(cluster: Mapping[str, Any] | None):
    """None (TensorFlow reads TF_CONFIG itself), or a resolver for a `tf_config=` given in code."""
    if cluster is None:
        return None
    task = cluster["task"]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster["cluster"]), task_type=task["type"], task_id=task["index"],
        rpc_layer=cluster.get("rpc_layer", "grpc"),
    )


def _build_tpu(resolver=None, **_):
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


# One place that builds each strategy; tests replace entries to check the
# arguments without the hardware.
_BUILDERS: dict[str, Callable[..., tf.distribute.Strategy]] = {
    "default": _build_default,
    "mirrored": _build_mirrored,
    "multi_worker_mirrored": _build_multi_worker,
    "tpu": _build_tpu,
}


# --------------------------------------------------------------------------
# prepare(model): fit() under MultiWorkerMirroredStrategy
# --------------------------------------------------------------------------


def prepare(model: keras.Model, *, jit_compile: bool | str = "auto") -> keras.Model:
    """Make `model.fit()` work, and fast, under tf.distribute strategies; returns `model`.

    Call it after creating the model (in the strategy's scope, as Keras
    requires) and before `fit()`; inside or outside the scope both work.
    Calling it again only changes `jit_compile`. It changes this instance
    only: other models, and Keras's classes, are untouched.

    `jit_compile`, with several replicas (Mirrored, MultiWorkerMirrored):
    "auto" or True compiles each replica's forward/backward pass with XLA
    (kmp.replica_step; "auto" unless a layer does not support XLA), and the
    all-reduce stays outside; False keeps Keras's step without XLA. Keras's
    own `compile(jit_compile=True)`, which fails under a strategy, is turned
    into the same. On one replica, True turns Keras's whole-step XLA on and
    "auto"/False leave the compile() setting as it is.

    Two of the instance's methods are replaced, each delegating to Keras's
    (besides the XLA step above):

    1. `_maybe_symbolic_build`: before the first step Keras builds the model,
       metrics and optimizer from the shapes and dtypes of one data batch,
       which it gets from the distributed first batch as

           batch = strategy.reduce("MEAN", first_batch, axis=None)      # Keras
           batch = strategy.experimental_local_results(first_batch)[0]  # prepared

       Every replica's share of a global batch has the same shapes. Keras's
       reduce fails across workers (keras-team/keras#20585), and it turns
       integer labels into float64; one local replica's share needs no
       communication and has the dtypes the train step will see.
    2. `_make_function` (multi-worker only): Keras reduces each step's logs
       with `strategy.reduce("MEAN", v, axis=0)`, which fails for a scalar
       loss. The step's outputs get a leading axis of 1, so that same reduce
       is the mean over replicas and returns the original shape.
    """
    stock = getattr(type(model), "_maybe_symbolic_build", None)
    if not isinstance(model, keras.Model) or stock is None:
        check([Problem("model", "a keras.Model built by Keras's TensorFlow backend", type(model).__name__,
                       "Pass the model itself, e.g. kmp.distribute.prepare(model).")],
              "kmp.distribute.prepare arguments")
    if jit_compile not in replica_step.JIT_CHOICES:
        check([Problem("jit_compile", '"auto", True or False', jit_compile)], "kmp.distribute.prepare arguments")
    if getattr(model, "_kmp_jit_compile", jit_compile) != jit_compile:
        model.train_function = None  # built with the old setting: rebuild at the next fit()
    model._kmp_jit_compile = jit_compile
    if is_prepared(model):
        return model
    # Bound methods stored on the instance shadow the class's methods for
    # this instance only (tests/test_distribute.py checks both).
    for name, method in _REPLACEMENTS.items():
        setattr(model, name, types.MethodType(method, model))
    return model


def is_prepared(model: keras.Model) -> bool:
    """Whether `prepare(model)` was called on this instance."""
    return all(
        getattr(vars(model).get(name), "__func__", None) is method for name, method in _REPLACEMENTS.items()
    )


def _build_from_local_batch(self, iterator=None, data_batch=None):
    # Keras's method skips its reduce when handed a batch instead of an
    # iterator; hand it one replica's share of the first batch.
    if iterator is not None and self._distribute_strategy is not None:
        for _, _, batches in iterator:
            data_batch = local_batch(self.distribute_strategy, next(batches))
            break
        iterator = None
    return type(self)._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)


def _make_function_prepared(self, step_function):
    setting = getattr(self, "_kmp_jit_compile", "auto")
    several = self.distribute_strategy.num_replicas_in_sync > 1
    # Only Keras's own train_step is swapped: a model's custom one is kept.
    if (
        getattr(step_function, "__func__", None) is _keras_trainer.TensorFlowTrainer.train_step
        and replica_step.wants_replica_xla(self, setting)
    ):
        step_function = functools.partial(replica_step.train_step, self)
    # Under MultiWorkerMirroredStrategy, Keras reduces each step's outputs
    # (the logs) with strategy.reduce("MEAN", v, axis=0), which fails for
    # scalars and averages a vector's entries. With a leading axis of 1 per
    # replica, that same reduce is the mean over replicas, shape unchanged.
    if _keras_trainer._collective_all_reduce_multi_worker(self.distribute_strategy):
        step_function = _with_replica_axis(step_function)
    # Keras's jit_compile puts the whole distributed step in one XLA
    # computation, which fails with several replicas.
    whole_step_xla = (setting is True or bool(self.jit_compile)) and not several
    saved, self._jit_compile = self._jit_compile, whole_step_xla
    try:
        return type(self)._make_function(self, step_function)
    finally:
        self._jit_compile = saved


def _with_replica_axis(step_function):
    @functools.wraps(step_function)
    def step(data):
        return keras.tree.map_structure(
            lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, step_function(data)
        )

    return step


_REPLACEMENTS = {
    "_maybe_symbolic_build": _build_from_local_batch,
    "_make_function": _make_function_prepared,
}


def local_batch(strategy: tf.distribute.Strategy, batch):
    """The first local replica's part of a distributed batch; other batches as they are."""
    leaves = keras.tree.flatten(batch)
    if leaves and all(isinstance(v, tf.distribute.DistributedValues) for v in leaves):
        return keras.tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)
    return batch


# --------------------------------------------------------------------------
# TPU
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TpuSettings:
    """What a TPU run should use. `advice` lists what the given model does differently."""

    precision: Precision
    steps_per_execution: int
    advice: tuple[str, ...] = ()


def is_tpu_strategy(strategy) -> bool:
    """Keras's own test: a class named TPUStrategy* anywhere among its bases."""
    return any(k.__name__.startswith("TPUStrategy") for k in type(strategy).__mro__)


def tpu_settings(strategy, model: keras.Model | None = None) -> TpuSettings | None:
    """TPU settings for `strategy`, or None when it is not a TPUStrategy.

    Nothing global is changed; apply them yourself, before building the model:

        settings = kmp.distribute.tpu_settings(strategy)
        if settings:
            kmp.set_precision(settings.precision)      # mixed_bfloat16
        ... model.compile(..., steps_per_execution=settings.steps_per_execution)
        kmp.distribute.tpu_settings(strategy, model)   # warns about padded sizes

    With `model`, one UserWarning lists the layer sizes that are not
    multiples of 128 (Dense units and input features, Conv filters and
    input channels, Embedding output_dim), a steps_per_execution below the
    recommendation, and a float16 policy (TPUs compute in bfloat16).
    """
    if not is_tpu_strategy(strategy):
        return None
    precision = resolve_precision("auto", hardware=Hardware("tpu"))
    advice: list[str] = []
    if model is not None:
        advice += padded_sizes(model)
        steps = getattr(model, "steps_per_execution", None)
        if steps is not None and steps < TPU_STEPS_PER_EXECUTION:
            advice.append(
                f"steps_per_execution={steps}: each step is a host -> TPU round trip. "
                f"Compile with steps_per_execution={TPU_STEPS_PER_EXECUTION}."
            )
        policy = keras.config.dtype_policy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_hardware(policy, Hardware("tpu"))
        advice += [str(w.message) for w in caught]
    if advice:
        lines = "\n".join(f"  - {a}" for a in advice)
        warnings.warn(f"On TPU, this model runs slower than it could:\n{lines}", UserWarning, stacklevel=2)
    return TpuSettings(precision, TPU_STEPS_PER_EXECUTION, tuple(advice))


def padded_sizes(model: keras.Model, tile: int = TPU_TILE) -> list[str]:
    """One line per Dense/Conv/Embedding size that is not a multiple of `tile`."""
    out = []
    for layer in _walk(model):
        for what, size in _sizes(layer):
            if size is not None and size % tile:
                out.append(f"{layer.name} ({type(layer).__name__}): {what}={size} is not a multiple of {tile}")
    return out


def _walk(layer):
    for child in getattr(layer, "layers", []):
        yield child
        yield from _walk(child)


def _sizes(layer) -> list[tuple[str, int | None]]:
    kernel = getattr(layer, "kernel", None) if layer.built else None
    if isinstance(layer, keras.layers.Dense):
        return [("units", layer.units), ("input features", None if kernel is None else int(kernel.shape[0]))]
    if isinstance(layer, _CONV):
        return [("filters", layer.filters), ("input channels", None if kernel is None else int(kernel.shape[-2]))]
    if isinstance(layer, keras.layers.Embedding):
        return [("output_dim", layer.output_dim)]
    return []


_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)

__all__ = [
    "STRATEGIES",
    "TPU_STEPS_PER_EXECUTION",
    "TPU_TILE",
    "TpuSettings",
    "is_prepared",
    "is_tpu_strategy",
    "local_batch",
    "padded_sizes",
    "prepare",
    "resolve_strategy",
    "strategy_from_config",
    "tpu_settings",
]
