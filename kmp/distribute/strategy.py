"""Choosing a tf.distribute strategy.

`resolve_strategy("auto")` picks what the machine and the cluster call for:

    if a TPU cluster resolver is found:        TPUStrategy
    elif TF_CONFIG names > 1 chief + worker:   MultiWorkerMirroredStrategy
    elif more than one GPU:                    MirroredStrategy
    else:                                      tf.distribute.get_strategy()

Every detection input (`tf_config=`, `tpu=`, `gpus=`) can be given, so each
branch is tested without the hardware. A config names the strategy under
`"kmp": {"strategy": ...}` (`strategy_from_config`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable, Mapping, Union

import tensorflow as tf

from kmp.config.deepspeed import load_config
from kmp.config.settings import STRATEGIES, Config, StrategyName
from kmp.distribute.leaving import leave_last
from kmp.errors import Problem, check, did_you_mean
from kmp.values import is_int, key_name

logger = logging.getLogger(__name__)


# TF_CONFIG task types that MultiWorkerMirroredStrategy knows ("ps" is
# ParameterServerStrategy's, which kmp does not choose).
_TASK_TYPES = ("chief", "worker", "evaluator")

TpuLike = Union[tf.distribute.cluster_resolver.ClusterResolver, Callable[[], Any], None]


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
        except (ValueError, RecursionError) as e:  # also: an int past Python's digit limit, nesting past its stack
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
        where = f"{path}.cluster.{key_name(job)}"
        if job == "ps":
            out.append(Problem(where, "no parameter servers (kmp chooses only all-reduce strategies)",
                               addresses, "Create tf.distribute.ParameterServerStrategy yourself and "
                               "pass it as the strategy."))
        elif job not in _TASK_TYPES:
            out.append(Problem(where, f"a job named one of {', '.join(map(repr, _TASK_TYPES))}", addresses,
                               did_you_mean(str(job), _TASK_TYPES)))
        if not isinstance(addresses, list) or not all(_is_address(a) for a in addresses):
            out.append(Problem(where, 'a list of "host:port" strings', addresses,
                               "A port is a number from 1 to 65535."))
        elif job in ("chief", "evaluator") and len(addresses) > 1:
            out.append(Problem(where, f"at most one {job} address (TensorFlow allows one)", addresses))
    rpc_layer = raw.get("rpc_layer", "grpc")
    if not isinstance(rpc_layer, str) or not rpc_layer.strip():
        out.append(Problem(f"{path}.rpc_layer", 'a protocol name such as "grpc"', rpc_layer))
    if not isinstance(task, Mapping):
        out.append(Problem(f"{path}.task", 'an object such as {"type": "worker", "index": 0}', task))
        return out
    kind, index = task.get("type"), task.get("index")
    if not isinstance(kind, str) or kind not in cluster:  # isinstance first: a list is unhashable
        names = ", ".join(map(repr, cluster)) or "none"
        out.append(Problem(f"{path}.task.type", f"a job of the cluster ({names})", kind))
    else:
        count = len(cluster[kind]) if isinstance(cluster[kind], list) else 0
        if not is_int(index) or not 0 <= index < count:
            out.append(Problem(f"{path}.task.index", f"an integer from 0 to {count - 1} "
                               f"(cluster.{kind} has {count} addresses)", index))
    return out


def _is_address(value: Any) -> bool:
    host, colon, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    return bool(colon and host.strip() and re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535)


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
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=_cluster_resolver(cluster), communication_options=communication_options
    )
    leave_last(strategy)
    return strategy


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
