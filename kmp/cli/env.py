"""`kmp env`: what kmp finds on this machine, and what will run here.

The report DeepSpeed's `ds_report` and Lightning's start-up lines give a
PyTorch user, for kmp:

    versions   kmp, Python, TensorFlow, Keras, tensorflow-datasets against kmp's pins
    cpu        the flags that decide float16/bfloat16 speed on a CPU (Linux)
    devices    each device, with kmp.check_hardware's verdict on float16 and bfloat16
    xla        a tiny jit_compile=True function compiled and run, time-bounded
    float16 convolutions  a convolution's weight gradient timed in float16 against float32
    auto       what precision="auto" resolves to here, and why
    features   which kmp features run on this machine

Everything before `collect` needs no TensorFlow, so `kmp --version` and the
pin check stay fast. TensorFlow prints start-up lines on stderr that
TF_CPP_MIN_LOG_LEVEL does not silence (Abseil's C++ logging); `collect` takes
them from file descriptor 2 and keeps them in the report instead.
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.metadata
import logging
import os
import platform
import socket
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import kmp

PACKAGES = ("tensorflow", "keras", "tensorflow-datasets", "packaging")
# /proc/cpuinfo flag -> why it matters (oneDNN picks its kernels by these).
CPU_FLAGS = {
    "avx512_bf16": "bfloat16 dot products (oneDNN's native bfloat16 kernels)",
    "avx512_fp16": "float16 arithmetic (oneDNN's native float16 kernels)",
    "amx_bf16": "AMX tiles in bfloat16 (Sapphire Rapids and later)",
    "amx_fp16": "AMX tiles in float16 (Granite Rapids and later)",
}
_SOURCE_TREE = Path(kmp.__file__).resolve().parent.parent


# --- versions and pins (no TensorFlow) ------------------------------------------


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pins() -> tuple[dict[str, str], str]:
    """kmp's requirement specifiers by package ("python" included), and where they were read.

    From setup.cfg when kmp runs from a source tree (the installed metadata
    may belong to another checkout), else from the installed metadata.
    """
    from packaging.requirements import Requirement

    setup_cfg = _SOURCE_TREE / "setup.cfg"
    cfg = configparser.ConfigParser()
    if setup_cfg.is_file() and cfg.read(setup_cfg) and cfg.get("metadata", "name", fallback="") == "kmp":
        lines = cfg.get("options", "install_requires", fallback="").splitlines()
        python, source = cfg.get("options", "python_requires", fallback=""), "setup.cfg"
    else:
        try:
            lines = importlib.metadata.requires("kmp") or []
            python = importlib.metadata.metadata("kmp").get("Requires-Python", "")
        except importlib.metadata.PackageNotFoundError:
            return {}, "nowhere (kmp is neither installed nor in a source tree)"
        source = "installed metadata"
    found = {"python": python} if python else {}
    for line in lines:
        if not line.strip():
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):  # not the test extras
            found[requirement.name] = str(requirement.specifier)
    return found, source


def check_pin(installed: str | None, specifier: str) -> str:
    """"OK", "MISMATCH" or "MISSING": is `installed` (a version string) within `specifier`?"""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if installed is None:
        return "MISSING"
    try:
        inside = SpecifierSet(specifier).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        inside = False  # a version pip could not compare either
    return "OK" if inside else "MISMATCH"


def versions() -> tuple[list[dict[str, Any]], str]:
    required, source = pins()
    rows = []
    for name in ("python", *PACKAGES):
        installed = platform.python_version() if name == "python" else installed_version(name)
        specifier = required.get(name, "")
        status = check_pin(installed, specifier) if specifier else ("OK" if installed else "MISSING")
        rows.append({"name": name, "installed": installed, "required": specifier, "status": status})
    return rows, source


def version_line() -> str:
    """What `kmp --version` prints: kmp's version and where it runs from, and the versions it runs on."""
    others = ", ".join(f"{name} {installed_version(name) or 'not installed'}" for name in ("tensorflow", "keras"))
    return f"kmp {kmp.__version__} from {Path(kmp.__file__).parent} (python {platform.python_version()}, {others})"


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU model and CPU_FLAGS as /proc/cpuinfo reports them; flags None where it cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {"model": platform.processor() or None, "source": None, "flags": {f: None for f in CPU_FLAGS}}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}  # the last processor's; they agree
    present = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "source": str(cpuinfo), "flags": {f: f in present for f in CPU_FLAGS}}


def free_local_ports(count: int = 2) -> list[int]:
    """`count` ports free on 127.0.0.1 now, as a local multi-worker job needs; [] if none can be bound."""
    with contextlib.ExitStack() as stack:
        try:
            sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
            for s in sockets:
                s.bind(("127.0.0.1", 0))
        except OSError:
            return []
        return [s.getsockname()[1] for s in sockets]


# --- what TensorFlow sees ---------------------------------------------------------


@contextlib.contextmanager
def _stderr_to(lines: list[str]) -> Iterator[None]:
    """Collect what is written to file descriptor 2 (C++ logs included) into `lines`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def _speed(precision: str, hardware, flags: dict[str, Any]) -> dict[str, str]:
    """kmp.check_hardware's verdict on `precision` for `hardware`, with what the CPU flags add."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kmp.check_hardware(precision, hardware)
    if caught:
        note = str(caught[0].message).split(": ", 1)[-1]
        if hardware.kind == "cpu" and precision == "mixed_float16" and flags.get("avx512_fp16"):
            note += " (This CPU reports AVX512_FP16, which oneDNN uses for float16: measure before trusting either.)"
        return {"status": "slow", "note": note}
    if hardware.kind == "cpu":  # check_hardware cannot tell for bfloat16 on a CPU; the flags can
        fast = [f.upper() for f in ("avx512_bf16", "amx_bf16") if flags.get(f)]
        if fast:
            return {"status": "fast", "note": f"{' and '.join(fast)}: oneDNN runs bfloat16 natively "
                                              "(docs/precision.md measured 0.5-0.8x float32's step time with AVX512_BF16)"}
        if all(flags.get(f) is False for f in ("avx512_bf16", "amx_bf16")):
            return {"status": "slow", "note": "no AVX512_BF16 or AMX: bfloat16 is emulated"}
        return {"status": "unknown", "note": "CPU flags unreadable (not Linux?)"}
    if hardware.kind == "gpu" and hardware.compute_capability is None:
        return {"status": "unknown", "note": "compute capability unknown"}
    return {"status": "fast", "note": ""}


def _devices(tf, flags: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for device in tf.config.list_physical_devices():
        kind = device.device_type.lower()
        if kind not in ("cpu", "gpu", "tpu"):
            continue
        details = tf.config.experimental.get_device_details(device) if kind == "gpu" else {}
        capability = details.get("compute_capability")
        hardware = kmp.Hardware(kind, capability)
        rows.append({
            "name": device.name,
            "type": device.device_type,
            "details": {k: (list(v) if isinstance(v, tuple) else v) for k, v in details.items()},
            "mixed_float16": _speed("mixed_float16", hardware, flags),
            "mixed_bfloat16": _speed("mixed_bfloat16", hardware, flags),
        })
    return rows


def _xla(tf, timeout: float) -> dict[str, Any]:
    """Compile and run sum(x * x) for x = 0, 1, 2, 3 with XLA, in at most `timeout` seconds."""
    outcome: dict[str, Any] = {}

    def probe() -> None:
        try:
            value = float(tf.function(lambda x: tf.reduce_sum(x * x), jit_compile=True)(tf.range(4.0)))
            outcome["error"] = None if value == 14.0 else f"computed {value}, expected 14"
        except Exception as error:  # any failure means "XLA does not work here"; say which
            outcome["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    start = time.perf_counter()
    # A daemon thread: a compile that hangs must not keep the report (or the process) waiting.
    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = round(time.perf_counter() - start, 3)
    if worker.is_alive():
        return {"works": False, "seconds": seconds, "error": f"no result within {timeout:g} s"}
    return {"works": outcome["error"] is None, "seconds": seconds, "error": outcome["error"]}


# The probe's shapes: small enough that the probe takes well under a second where float16 is slow.
_CONVOLUTION = {"input": (8, 16, 16, 32), "filter": (3, 3, 32, 32)}
# At this ratio or more a conv net's float16 step outside XLA is dominated by the weight gradient.
SLOW_CONVOLUTIONS = 10.0


def _float16_convolutions(tf) -> dict[str, float]:
    """A 3x3 convolution's weight gradient on the CPU, best of three, in float32 and in float16.

    On CPUs with AVX512_FP16, TensorFlow's oneDNN kernels run it in float16 with oneDNN's reference
    (unvectorized) kernel, which then dominates a conv net's step (benchmarks/float16_convolutions.py).
    """
    shape, sizes = _CONVOLUTION["input"], _CONVOLUTION["filter"]

    def best(dtype) -> float:
        x = tf.random.stateless_normal(shape, (1, 2), dtype=dtype)
        dy = tf.random.stateless_normal(shape[:3] + sizes[3:], (3, 4), dtype=dtype)
        times = []
        for _ in range(4):  # the first run warms up
            start = time.perf_counter()
            tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=sizes, out_backprop=dy, strides=[1, 1, 1, 1],
                                            padding="SAME").numpy()
            times.append(time.perf_counter() - start)
        return min(times[1:]) * 1e3

    try:
        with tf.device("/CPU:0"):
            float32, float16 = best(tf.float32), best(tf.float16)
    except Exception as error:  # a TensorFlow without float16 convolutions here: say so, report the rest
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    return {"float32_ms": round(float32, 3), "float16_ms": round(float16, 3), "ratio": round(float16 / float32, 1)}


def convolution_note(result: dict[str, float], onednn: bool) -> str:
    """What the float16 convolution probe means for a user, with the remedy when it is slow."""
    if "error" in result:
        return f"could not run ({result['error']})"
    line = f"{result['ratio']:g}x float32's time ({result['float16_ms']:.2f} against {result['float32_ms']:.2f} ms)"
    if result["ratio"] < SLOW_CONVOLUTIONS:
        return line
    if onednn:
        return (line + ": oneDNN runs it with a slow reference kernel here. TF_ENABLE_ONEDNN_OPTS=0, set before "
                "TensorFlow starts, swaps in TensorFlow's own kernels; an XLA-compiled step (kmp.prepare's "
                "per-replica step, jit_compile=True) uses XLA's (docs/precision.md, \"On CPU\", has what each costs)")
    return line + ": a conv net's float16 step is that much slower outside XLA; compile it with XLA, or use float32"


def _auto() -> dict[str, str]:
    """kmp.resolve_precision("auto") here, with the reason kmp.precision logs for it."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kmp.precision")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        chosen = kmp.resolve_precision("auto")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    why = [r.getMessage() for r in records if r.getMessage().startswith("precision='auto'")]
    return {"precision": str(chosen), "why": why[-1].split(": ", 1)[-1].rstrip(".") if why else ""}


def _features(report: dict[str, Any], tf) -> list[dict[str, Any]]:
    """Each kmp feature: does it run here, and what to expect."""
    hardware = kmp.Hardware.detect()  # the device kmp's checks and "auto" go by
    device = next((d for d in report["devices"] if d["type"].lower() == hardware.kind), None)
    rows = []
    for precision in ("mixed_float16", "mixed_bfloat16"):
        speed = device[precision] if device else {"status": "unknown", "note": "no device listed"}
        note = f"{speed['status']} on {hardware.kind.upper()}" + (f": {speed['note']}" if speed["note"] else "")
        rows.append({"feature": precision, "runs": True, "note": note})
    xla = report["xla"]
    rows.append({"feature": "XLA", "runs": xla["works"], "note": (
        "jit_compile=True, kmp's fused update (fused=True), kmp.prepare's per-replica step"
        if xla["works"] else f"{xla['error']}: use fused=False and prepare(model, jit_compile=False)")})
    gpus = len(tf.config.list_logical_devices("GPU"))
    cpus = len(tf.config.list_logical_devices("CPU"))
    split = ("tf.config.set_logical_device_configuration splits it before TensorFlow starts "
             "(replicas for tests, not speed)")
    if gpus > 1:
        mirrored = f"over {gpus} GPUs; resolve_strategy('auto') picks it"
    elif cpus > 1 and not gpus:
        mirrored = f"over {cpus} logical CPU devices (they share the CPU's cores: for tests, not speed)"
    else:
        mirrored = f"one {'GPU' if gpus else 'CPU device'} here: one replica; {split}"
    rows.append({"feature": "MirroredStrategy", "runs": True, "note": mirrored})
    ports = free_local_ports(2)
    if os.environ.get("TF_CONFIG"):
        multi = "TF_CONFIG is set: resolve_strategy('auto') builds the cluster it names"
    elif ports:
        multi = "local workers can bind 127.0.0.1 ports (recipes/multiworker.py --workers 2)"
    else:
        multi = "no free port on 127.0.0.1: local workers cannot start; set TF_CONFIG for a real cluster"
    rows.append({"feature": "MultiWorkerMirroredStrategy", "runs": bool(ports or os.environ.get("TF_CONFIG")),
                 "note": multi})
    tpu = hardware.kind == "tpu" or bool(tf.config.list_physical_devices("TPU"))
    rows.append({"feature": "TPUStrategy", "runs": tpu, "note": "TPU found" if tpu else (
        "no TPU: kmp's TPU settings are unit-tested seams only, never run on a TPU")})
    return rows


def collect(xla_timeout: float = 60.0) -> dict[str, Any]:
    """The whole report as plain data (what `kmp env --json` prints)."""
    packages, source = versions()
    report: dict[str, Any] = {
        "kmp": {"version": kmp.__version__, "location": str(Path(kmp.__file__).parent)},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "pins_from": source,
        "packages": packages,
        "cpu": cpu_flags(),
        "devices": [], "logical_devices": [], "xla": None, "float16_convolutions": None, "auto_precision": None,
        "features": [],
        "tensorflow_error": None,
        "tensorflow_log": [],
    }
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        with _stderr_to(report["tensorflow_log"]):
            import tensorflow as tf

            with contextlib.suppress(ImportError):
                from absl import logging as absl_logging

                absl_logging.set_verbosity(absl_logging.ERROR)
            report["devices"] = _devices(tf, report["cpu"]["flags"])
            # Not matched to physical devices: TensorFlow does not say which
            # physical device a logical one (a split of a GPU or CPU) lives on.
            report["logical_devices"] = [d.name for d in tf.config.list_logical_devices()]
            report["xla"] = _xla(tf, xla_timeout)
            report["float16_convolutions"] = _float16_convolutions(tf)
            report["auto_precision"] = _auto()
            report["features"] = _features(report, tf)
    except Exception as error:  # a broken TensorFlow is what this command must still report
        report["tensorflow_error"] = f"{type(error).__name__}: {error}"
    return report


def exit_code(report: dict[str, Any]) -> int:
    """1 when a pinned dependency is missing or outside its pin, else 0."""
    return int(any(row["status"] != "OK" for row in report["packages"]))


# --- text ----------------------------------------------------------------------------


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def render(report: dict[str, Any]) -> str:
    """The report as aligned plain text."""
    kmp_ = report["kmp"]
    out = [f"kmp {kmp_['version']} from {kmp_['location']}", f"python {report['python']['executable']}", ""]
    out.append(f"Versions (pins from {report['pins_from']})")
    out += _table([["package", "installed", "required", "status"]] + [
        [r["name"], r["installed"] or "-", r["required"] or "-", r["status"]] for r in report["packages"]])
    cpu = report["cpu"]
    out += ["", f"CPU: {cpu['model'] or 'unknown model'}"]
    out += _table([[flag.upper(), {True: "yes", False: "no", None: "?"}[have], why]
                   for flag, have in cpu["flags"].items() for why in [CPU_FLAGS[flag]]])
    if report["tensorflow_error"]:
        out += ["", f"TensorFlow failed: {report['tensorflow_error']}"]
        out += [f"  | {line}" for line in report["tensorflow_log"][-20:]]
        return "\n".join(out) + "\n"
    out += ["", "Devices"]
    out += _table([["physical", "mixed_float16", "mixed_bfloat16"]] + [
        [d["name"], d["mixed_float16"]["status"], d["mixed_bfloat16"]["status"]] for d in report["devices"]])
    for d in report["devices"]:
        if d["details"]:
            out.append(f"  {d['name']}: " + ", ".join(f"{k} {v}" for k, v in d["details"].items()))
    out.append(f"  logical: {', '.join(report['logical_devices']) or '-'}")
    xla, auto = report["xla"], report["auto_precision"]
    out += ["", "XLA: " + (f"works (compiled and ran in {xla['seconds']:.2f} s)" if xla["works"]
                           else f"does not work: {xla['error']}")]
    # TensorFlow says at start-up whether its oneDNN kernels are on (TF_ENABLE_ONEDNN_OPTS).
    onednn = any("oneDNN custom operations are on" in line for line in report["tensorflow_log"])
    out.append("float16 convolution gradient on the CPU: " + convolution_note(report["float16_convolutions"], onednn))
    out.append(f"precision='auto': {auto['precision']}" + (f" ({auto['why']})" if auto["why"] else ""))
    out += ["", "Features"]
    out += _table([[f["feature"], "runs" if f["runs"] else "no", f["note"]] for f in report["features"]])
    if report["tensorflow_log"]:
        out += ["", f"(TensorFlow wrote {len(report['tensorflow_log'])} log lines while starting; "
                    "`kmp env --json` has them.)"]
    return "\n".join(out) + "\n"
