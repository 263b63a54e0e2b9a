"""The `zero_optimization` block's keys and value types, as DeepSpeed's own block model declares them.

    unknown, problems, not_acted_on = check(block)     # the block's keys and values, checked

kmp acts on `stage` and the offload keys (kmp.config.deepspeed says what it
does instead); every other key tunes DeepSpeed's own ZeRO implementation
(buckets, overlap, stage 3's prefetching) and is named in the one warning of
keys kmp does not act on. As DeepSpeed's model forbids extra keys, an
unknown key is an error, with a did-you-mean. DeepSpeed leaves out "auto"
values (Hugging Face's, filled by its Trainer) before it checks a block, and
so does kmp.

Source: deepspeedai/DeepSpeed at commit 1b88ac366fc922254d56abda5cf6b1f266556d19,
deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig; keys by field name or
by their `stage3_` alias, as `populate_by_name=True` allows) and, at commit
1978617c691b2c992a17902975187ef8d61176fa, offload_config.py (the two offload
blocks); deepspeed/runtime/config_utils.py (DeepSpeedConfigModel:
`extra="forbid"`, "auto" values dropped). JSON booleans only where DeepSpeed
declares a bool, integers (5e8 written as a float too, as pydantic takes it)
where it declares an int.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from kmp.errors import Problem
from kmp.values import is_int, is_number

Kind = tuple[str, Callable[[Any], bool]]


def _integral(v: Any) -> bool:
    return is_int(v) or (is_number(v) and isinstance(v, float) and v.is_integer())


_BOOL: Kind = ("true or false", lambda v: isinstance(v, bool))
_OPTIONAL_BOOL: Kind = ("true, false or null", lambda v: v is None or isinstance(v, bool))
_SIZE: Kind = ("an integer >= 0", lambda v: _integral(v) and v >= 0)
_INT: Kind = ("an integer", _integral)
_OBJECT: Kind = ("a JSON object {...} or null", lambda v: v is None or isinstance(v, Mapping))
_FRACTION: Kind = ("a number from 0 to 1", lambda v: is_number(v) and 0 <= v <= 1)
_DEVICE: Kind = ("one of 'none', 'cpu', 'nvme'", lambda v: v in ("none", "cpu", "nvme"))
_PATH: Kind = ("a path (a string) or null", lambda v: v is None or isinstance(v, str))

_OFFLOAD_PARAM: dict[str, Kind] = {
    "device": _DEVICE, "nvme_path": _PATH, "buffer_count": _SIZE, "buffer_size": _SIZE, "max_in_cpu": _SIZE,
    "pin_memory": _BOOL,
}
_OFFLOAD_OPTIMIZER: dict[str, Kind] = {
    "device": _DEVICE, "nvme_path": _PATH, "buffer_count": _SIZE, "pin_memory": _BOOL, "pipeline_read": _BOOL,
    "pipeline_write": _BOOL, "fast_init": _BOOL, "ratio": _FRACTION, "super_offload": _BOOL,
    "convert_grad_on_cpu": _BOOL, "cpuadam_cores_perc": _FRACTION,
}
# Objects whose own keys are checked: the offload blocks (the others are DeepSpeed's alone).
BLOCKS: dict[str, dict[str, Kind]] = {"offload_param": _OFFLOAD_PARAM, "offload_optimizer": _OFFLOAD_OPTIMIZER}

# Every key but `stage` (kmp.config.deepspeed checks it), under its field name and its alias.
KEYS: dict[str, Kind] = {
    "contiguous_gradients": _BOOL, "reduce_scatter": _BOOL, "reduce_bucket_size": _SIZE,
    "use_multi_rank_bucket_allreduce": _BOOL, "allgather_partitions": _BOOL, "allgather_bucket_size": _SIZE,
    "overlap_comm": _OPTIONAL_BOOL, "load_from_fp32_weights": _BOOL, "elastic_checkpoint": _BOOL,
    "offload_param": _OBJECT, "offload_optimizer": _OBJECT, "zenflow": _OBJECT, "sub_group_size": _SIZE,
    "cpu_offload_param": _OPTIONAL_BOOL, "cpu_offload_use_pin_memory": _OPTIONAL_BOOL, "cpu_offload": _OPTIONAL_BOOL,
    "ignore_unused_parameters": _BOOL, "legacy_stage1": _BOOL, "round_robin_gradients": _BOOL,
    "zero_hpz_partition_size": _SIZE, "zero_quantized_weights": _BOOL, "zero_quantized_nontrainable_weights": _BOOL,
    "zero_quantized_gradients": _BOOL, "zeropp_loco_param": _OBJECT, "mics_shard_size": _INT,
    "mics_hierarchical_params_gather": _BOOL, "memory_efficient_linear": _BOOL, "pipeline_loading_checkpoint": _BOOL,
    "override_module_apply": _BOOL, "log_trace_cache_warnings": _BOOL, "enable_sanity_checks": _BOOL,
    "save_muon_momentum_buffer_in_memory": _BOOL, "leaf_module": ("a JSON object {...}",
                                                                  lambda v: isinstance(v, Mapping)),
    "stage3_gather_fp16_weights_on_model_save": _BOOL,
}
for _field, _kind in {"prefetch_bucket_size": _SIZE, "param_persistence_threshold": _SIZE,
                      "model_persistence_threshold": _SIZE, "max_live_parameters": _SIZE, "max_reuse_distance": _SIZE,
                      "gather_16bit_weights_on_model_save": _BOOL, "module_granularity_threshold": _INT,
                      "use_all_reduce_for_fetch_params": _BOOL, "allgather_sequential": _BOOL,
                      "partition_stream_chunk_size": _SIZE}.items():
    KEYS[f"stage3_{_field}"] = KEYS[_field] = _kind
# Keys kmp acts on, or says itself what it does instead of (kmp.config.deepspeed).
ACTED_ON = ("stage", "offload_param", "offload_optimizer", "cpu_offload")


def check(block: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], list[Problem], list[str]]:
    """(unknown keys as (path, value), problems of known keys' values, the paths kmp does not act on).

    The caller reports unknown keys as it does every block's (kmp.config.deepspeed).
    """
    unknown: list[tuple[str, Any]] = []
    problems: list[Problem] = []
    ignored: list[str] = []
    for key, value in block.items():
        path = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key not in KEYS:
            unknown.append((path, value))
            continue
        if key not in ACTED_ON:
            ignored.append(path)
        _check_value(path, value, KEYS[key], problems)
        if key in BLOCKS and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                if inner not in BLOCKS[key]:
                    unknown.append((f"{path}.{inner}", inner_value))
                else:
                    _check_value(f"{path}.{inner}", inner_value, BLOCKS[key][inner], problems)
    return unknown, problems, ignored


def _check_value(path: str, value: Any, kind: Kind, problems: list[Problem]) -> None:
    expected, accepts = kind
    if value == "auto" or accepts(value):  # "auto": left out, as DeepSpeed does
        return
    problems.append(Problem(path, expected, value))


def known(path: str) -> list[str]:
    """The keys known where `path` (zero_optimization.key or zero_optimization.block.key) is."""
    parts = path.split(".")
    return ["stage", *KEYS] if len(parts) == 2 else list(BLOCKS[parts[1]])
