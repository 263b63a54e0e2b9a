"""The `kmp` command (kmp/cli/main.py, kmp/cli/env.py) and the lazy `import kmp`.

Commands run as a user runs them, in a fresh process from this source tree,
without TF_CPP_MIN_LOG_LEVEL: "quiet" means the command itself keeps
TensorFlow's start-up lines off stderr.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import tensorflow as tf

import kmp
from kmp.cli import main as cli
from kmp.cli import env

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("tensorflow", "keras")
FEATURES = ["mixed_float16", "mixed_bfloat16", "XLA", "MirroredStrategy", "MultiWorkerMirroredStrategy", "TPUStrategy"]


def _environ() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
    environ["PYTHONPATH"] = str(ROOT)
    return environ


def run_kmp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kmp.cli.main", *args], cwd=ROOT, env=_environ(),
                          capture_output=True, text=True, timeout=timeout)


def run_python(code: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs `code` in a fresh process; returns it and which of HEAVY it left in sys.modules."""
    out = tmp_path / "modules.json"
    script = (
        "import json, sys\n"
        "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) +
        "except SystemExit:\n    pass\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        f"open({str(out)!r}, 'w').write(json.dumps(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_environ(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done, json.loads(out.read_text())


# --- import kmp: lazy, and every public name as before -----------------------------


def test_import_and_load_config_leave_tensorflow_out(tmp_path):
    done, heavy = run_python(
        "import kmp\n"
        "from kmp import ConfigError, load_config\n"
        "config = kmp.load_config({'fp16': {'enabled': True, 'hysteresis': 3}, 'gradient_clipping': 1.0})\n"
        "assert config.loss_scale.hysteresis == 3 and config.gradient_clipping == 1.0, config\n"
        "try:\n    load_config({'fp16': {'enabled': 'yes'}})\n"
        "except ConfigError:\n    print('refused')\n",
        tmp_path)
    assert heavy == [] and done.stderr == ""
    assert done.stdout == "refused\n"


def test_pure_modules_import_without_tensorflow(tmp_path):
    done, heavy = run_python("import kmp.errors, kmp.values, kmp.config.settings, kmp.config.deepspeed, "
                             "kmp.schedules.formulas, kmp.scaling.state, kmp.memory.estimate, kmp.cli.env", tmp_path)
    assert heavy == [] and done.stderr == ""


def test_every_public_name_is_its_modules_object():
    homes = {"callbacks": "kmp.callbacks", "distribute": "kmp.distribute"}
    for name in kmp.__all__:
        value = getattr(kmp, name)
        if name in homes:
            assert value is importlib.import_module(homes[name])
        else:
            assert not isinstance(value, types.ModuleType), name
            assert value is getattr(importlib.import_module(value.__module__), name), name
    namespace: dict = {}
    exec("from kmp import *", namespace)
    assert set(kmp.__all__) <= namespace.keys()
    assert set(kmp.__all__) <= set(dir(kmp))
    assert kmp.seams is importlib.import_module("kmp.seams")  # private modules still reachable as attributes
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kmp.no_such_name


def test_wrap_stays_the_function_when_its_module_is_imported_first(tmp_path):
    done, heavy = run_python(
        "import kmp.scaling.wrap\nimport kmp\n"
        "import types\nassert not isinstance(kmp.wrap, types.ModuleType)\n"
        "assert kmp.wrap is sys.modules['kmp.scaling.wrap'].wrap\nprint(kmp.wrap.__name__)\n",
        tmp_path)
    assert done.stdout == "wrap\n"


@pytest.fixture(scope="module")
def kmp_keras_file(tmp_path_factory):
    """A `.keras` file of a model trained with kmp's optimizer (read only)."""
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    path = tmp_path_factory.mktemp("kmp_keras_file") / "model.keras"
    model.save(path)
    return path


@pytest.mark.parametrize("imports", ["import keras, kmp", "import kmp, keras"])
def test_keras_and_kmp_in_either_order_load_a_keras_file_with_kmps_optimizer(tmp_path, kmp_keras_file, imports):
    """kmp's optimizer is registered with Keras as soon as both are imported, as the eager import did."""
    done, _ = run_python(
        f"{imports}\n"
        f"print(type(keras.saving.load_model({str(kmp_keras_file)!r}).optimizer).__name__)\n",
        tmp_path)
    assert done.stdout == "LossScaleOptimizer\n"


# Forked once per defining module by test_every_public_name_works_first_thing_in_a_fresh_process. The parent
# has loaded what TensorFlow's import spends its time on but that is neither TensorFlow's, Keras's nor kmp's
# Python: the third-party packages it imports and its shared libraries. Each child so starts with the same
# modules as a fresh process, less those, and skips half of TensorFlow's import.
FIRST_USE = """
import ctypes, importlib, importlib.util, json, os, sys, traceback

# The submodules too (matplotlib.pyplot: keras.src.visualization imports it): 3 s of each child's import otherwise.
for package in ("numpy", "scipy", "scipy.sparse", "h5py", "ml_dtypes", "google.protobuf", "absl", "wrapt", "opt_einsum",
                "IPython", "jedi", "requests", "rich", "rich.console", "optree", "namex", "matplotlib",
                "matplotlib.pyplot", "mpl_toolkits.mplot3d", "flatbuffers", "gast", "termcolor", "psutil"):
    try:
        importlib.import_module(package)
    except ImportError:
        pass
library = os.path.dirname(importlib.util.find_spec("tensorflow").origin)
for name in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2", "python/lib_pywrap_tensorflow_common.so",
             "python/_pywrap_tensorflow_internal.so"):
    ctypes.CDLL(os.path.join(library, name), mode=ctypes.RTLD_GLOBAL)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "kmp"))
assert loaded == [], loaded


def first_use(names):
    import kmp
    for name in names:
        getattr(kmp, name)
    if "keras" in sys.modules:
        import keras
        assert "kmp>LossScaleOptimizer" in keras.saving.get_custom_objects(), "not registered"


def child(names):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            first_use(names)
            failure = ""
        except BaseException:
            failure = traceback.format_exc().strip().splitlines()[-1]
        os.write(write, failure.encode())
        os._exit(0)
    os.close(write)
    return pid, read


def result(names, pid, read):
    with os.fdopen(read) as pipe:
        failure = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status and not failure:
        failure = f"the process ended with status {status}"
    return f"{names[0]}: {failure}" if failure else ""


homes = json.loads(sys.argv[1])
failures = []
for pair in (homes[i:i + 2] for i in range(0, len(homes), 2)):  # two at a time: each imports TensorFlow
    running = [(names, *child(names)) for names in pair]
    failures += [failure for failure in (result(*run) for run in running) if failure]
print(json.dumps(failures))
"""


@pytest.mark.slow
def test_every_public_name_works_first_thing_in_a_fresh_process():
    """`import kmp; kmp.<name>` before Keras is imported, once per defining module; Keras then knows kmp's classes.

    A name's first use imports its module, which fails or not whatever the
    name; the other names of that module are touched after it. kmp's
    registering modules import some of these modules back, so this is where
    an import cycle shows. Each module's first use is in a process forked for
    it from one that has imported no TensorFlow, Keras or kmp (FIRST_USE).
    """
    homes: dict[str, list[str]] = {}
    for name in kmp.__all__:
        homes.setdefault(kmp._HOMES[name] or f"kmp.{name}", []).append(name)
    done = subprocess.run([sys.executable, "-c", FIRST_USE, json.dumps(list(homes.values()))], cwd=ROOT,
                          env=_environ(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_keras_file_from_kmp_loads_without_kmp_with_compile_false(tmp_path):
    """What docs/loss-scaling.md says: without `import kmp` only the full load fails, with Keras's message."""
    import keras
    import numpy as np

    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=kmp.wrap(keras.optimizers.Adam()), loss="mse")
    x = np.arange(8, dtype="float32").reshape(4, 2)
    model.fit(x, x[:, :1], verbose=0)
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    done, _ = run_python(
        "import keras, numpy as np\n"
        f"path, x = {str(tmp_path / 'model.keras')!r}, np.arange(8, dtype='float32').reshape(4, 2)\n"
        "try:\n    keras.saving.load_model(path)\nexcept TypeError as error:\n    print(str(error).split('.')[0])\n"
        "model = keras.saving.load_model(path, compile=False)\n"
        f"same = np.array_equal(model.predict(x, verbose=0), np.load({str(tmp_path / 'expected.npy')!r}))\n"
        "print(model.layers[0].dtype_policy.name, same, getattr(model, 'optimizer', None), 'kmp' in sys.modules)\n",
        tmp_path)
    assert done.stdout.splitlines() == ["Could not locate class 'LossScaleOptimizer'", "mixed_float16 True None False"]


def test_the_version_has_one_source():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: kmp.__version__"
    setupcfg = pytest.importorskip("setuptools.config.setupcfg")
    assert setupcfg.read_configuration(ROOT / "setup.cfg")["metadata"]["version"] == kmp.__version__


# --- kmp --help, kmp --version -------------------------------------------------------


def test_help_is_quick_and_quiet(tmp_path):
    done, heavy = run_python("from kmp.cli.main import main\nmain(['--help'])", tmp_path)
    assert heavy == [] and done.stderr == ""
    assert re.search(r"^\s+env\s", done.stdout, re.M) and re.search(r"^\s+demo\s", done.stdout, re.M)


def test_version(tmp_path):
    done, heavy = run_python("from kmp.cli.main import main\nsys.exit(main(['--version']))", tmp_path)
    assert heavy == [] and done.stderr == ""
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in HEAVY)
    assert done.stdout == (f"kmp {kmp.__version__} from {ROOT / 'kmp'} "
                           f"(python {platform.python_version()}, {versions})\n")


def test_no_command_is_a_usage_error():
    done = run_kmp()
    assert done.returncode == 2 and "a command is required" in done.stderr


# --- pins ----------------------------------------------------------------------------------


@pytest.mark.parametrize("installed, specifier, status", [
    ("2.21.0", "<2.22,>=2.21", "OK"),
    ("2.21.7", "<2.22,>=2.21", "OK"),
    ("2.22.0", "<2.22,>=2.21", "MISMATCH"),
    ("2.20.1", "<2.22,>=2.21", "MISMATCH"),
    ("2.21.0rc1", "<2.22,>=2.21", "MISMATCH"),  # a release candidate comes before 2.21
    ("3.15.1", ">=3.15,<3.16", "OK"),
    ("3.16.0.dev1", ">=3.15,<3.16", "MISMATCH"),
    ("not a version", ">=4.9", "MISMATCH"),
    (None, ">=4.9", "MISSING"),
])
def test_check_pin(installed, specifier, status):
    assert env.check_pin(installed, specifier) == status


def test_pins_come_from_setup_cfg_in_a_source_tree():
    pins, source = env.pins()
    assert source == "setup.cfg"
    assert set(pins) == {"python", *env.PACKAGES}  # the test extras are not pins
    for name, specifier in pins.items():  # this machine is set up as the pins say
        installed = platform.python_version() if name == "python" else importlib.metadata.version(name)
        assert env.check_pin(installed, specifier) == "OK", (name, installed, specifier)


def test_a_version_outside_the_pins_fails_the_report(monkeypatch):
    real = env.installed_version
    fake = {"tensorflow": "2.22.0", "keras": None}
    monkeypatch.setattr(env, "installed_version", lambda name: fake[name] if name in fake else real(name))
    rows, _ = env.versions()
    status = {row["name"]: row["status"] for row in rows}
    assert status == {"python": "OK", "tensorflow": "MISMATCH", "keras": "MISSING", "tensorflow-datasets": "OK",
                      "packaging": "OK"}
    assert env.exit_code({"packages": rows}) == 1
    monkeypatch.setattr(env, "installed_version", real)
    assert env.exit_code({"packages": env.versions()[0]}) == 0


# --- the parts of the report -----------------------------------------------------------


def test_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\n")
    assert env.cpu_flags(cpuinfo) == {
        "model": "Test CPU", "source": str(cpuinfo),
        "flags": {"avx512_bf16": True, "avx512_fp16": False, "amx_bf16": False, "amx_fp16": False},
    }
    assert set(env.cpu_flags(tmp_path / "missing")["flags"].values()) == {None}


@pytest.mark.parametrize("precision, hardware, flags, status", [
    ("mixed_float16", kmp.Hardware("cpu"), {}, "slow"),
    ("mixed_bfloat16", kmp.Hardware("cpu"), {"avx512_bf16": True, "amx_bf16": False}, "fast"),
    ("mixed_bfloat16", kmp.Hardware("cpu"), {"avx512_bf16": False, "amx_bf16": True}, "fast"),
    ("mixed_bfloat16", kmp.Hardware("cpu"), {"avx512_bf16": False, "amx_bf16": False}, "slow"),
    ("mixed_bfloat16", kmp.Hardware("cpu"), {"avx512_bf16": None, "amx_bf16": None}, "unknown"),
    ("mixed_float16", kmp.Hardware("gpu", (7, 0)), {}, "fast"),
    ("mixed_bfloat16", kmp.Hardware("gpu", (7, 5)), {}, "slow"),
    ("mixed_bfloat16", kmp.Hardware("gpu", (8, 0)), {}, "fast"),
    ("mixed_float16", kmp.Hardware("gpu", (6, 1)), {}, "slow"),
    ("mixed_float16", kmp.Hardware("gpu"), {}, "unknown"),
    ("mixed_float16", kmp.Hardware("tpu"), {}, "slow"),
    ("mixed_bfloat16", kmp.Hardware("tpu"), {}, "fast"),
])
def test_speed_is_check_hardwares_verdict(precision, hardware, flags, status):
    speed = env._speed(precision, hardware, flags)
    assert speed["status"] == status
    if status == "slow" and hardware.kind != "cpu" or precision == "mixed_float16" and hardware.kind == "cpu":
        with pytest.warns(UserWarning) as warned:
            kmp.check_hardware(precision, hardware)
        assert speed["note"].startswith(str(warned[0].message).split(": ", 1)[1])


def test_float16_note_names_avx512_fp16_when_the_cpu_has_it():
    assert "AVX512_FP16" in env._speed("mixed_float16", kmp.Hardware("cpu"), {"avx512_fp16": True})["note"]
    assert "AVX512_FP16" not in env._speed("mixed_float16", kmp.Hardware("cpu"), {"avx512_fp16": False})["note"]


def test_xla_check_is_time_bounded():
    works = env._xla(tf, 120)
    assert works["works"] is True and works["error"] is None and 0 < works["seconds"] < 120
    gave_up = env._xla(tf, 0)  # no compile finishes in no time
    assert not gave_up["works"] and gave_up["error"] == "no result within 0 s"


def test_free_local_ports():
    ports = env.free_local_ports(2)
    assert len(set(ports)) == 2 and all(0 < p < 65536 for p in ports)


def test_a_broken_tensorflow_is_reported_not_raised():
    report = {"kmp": {"version": "0", "location": "x"}, "python": {"executable": "python"}, "pins_from": "setup.cfg",
              "packages": [{"name": "tensorflow", "installed": None, "required": ">=2.21", "status": "MISSING"}],
              "cpu": env.cpu_flags("/nonexistent"), "tensorflow_error": "ImportError: no tensorflow",
              "tensorflow_log": ["a line TensorFlow wrote"]}
    text = env.render(report)
    assert "TensorFlow failed: ImportError: no tensorflow" in text and "| a line TensorFlow wrote" in text
    assert env.exit_code(report) == 1


# --- kmp env, whole ----------------------------------------------------------------------


def test_env_json():
    done = run_kmp("env", "--json")
    assert done.returncode == 0 and done.stderr == ""
    report = json.loads(done.stdout)
    assert {"kmp", "python", "pins_from", "packages", "cpu", "devices", "logical_devices", "xla", "auto_precision",
            "features", "tensorflow_error", "tensorflow_log"} <= report.keys()
    assert report["kmp"] == {"version": kmp.__version__, "location": str(ROOT / "kmp")}
    assert [(r["name"], r["installed"], r["status"]) for r in report["packages"]] == [
        ("python", platform.python_version(), "OK"),
        *((name, importlib.metadata.version(name), "OK") for name in env.PACKAGES)]
    assert report["tensorflow_error"] is None
    assert report["cpu"] == env.cpu_flags()
    # A fresh process sees one logical device per physical one (no conftest split there).
    physical = tf.config.list_physical_devices("CPU")
    cpus = [d for d in report["devices"] if d["type"] == "CPU"]
    assert [d["name"] for d in cpus] == [d.name for d in physical]
    assert [name for name in report["logical_devices"] if ":CPU:" in name] == ["/device:CPU:0"]
    assert report["xla"]["works"] is True
    convolutions = report["float16_convolutions"]
    assert convolutions["float32_ms"] > 0 and convolutions["float16_ms"] > 0
    # The ratio is rounded to 0.1 from the unrounded times, the times to 0.001 ms: on a CPU without fast
    # float16 convolutions (a ratio in the hundreds) the times' rounding moves the ratio by more than 0.1.
    f16, f32 = convolutions["float16_ms"], convolutions["float32_ms"]
    assert convolutions["ratio"] == pytest.approx(f16 / f32, abs=0.05 + f16 / f32 * 0.0005 * (1 / f16 + 1 / f32) + 1e-9)
    assert report["auto_precision"]["precision"] == str(kmp.resolve_precision("auto"))
    assert report["auto_precision"]["why"]
    assert [f["feature"] for f in report["features"]] == FEATURES
    assert report["features"][2]["runs"] is True  # XLA, as report["xla"] says


def test_env_text():
    done = run_kmp("env")
    assert done.returncode == 0 and done.stderr == ""
    text = done.stdout
    for name in ("python", *env.PACKAGES):
        assert re.search(rf"^  {re.escape(name)}\s+\S+\s+\S+\s+OK$", text, re.M), name
    assert re.search(r"^XLA: works \(compiled and ran in [\d.]+ s\)$", text, re.M)
    assert re.search(r"^float16 convolution gradient on the CPU: [\d.]+x float32's time \([\d.]+ against [\d.]+ ms\)",
                     text, re.M)
    assert f"precision='auto': {kmp.resolve_precision('auto')} (" in text
    for feature in FEATURES:
        assert re.search(rf"^  {feature}\s+(runs|no)\s+\S", text, re.M), feature


def test_env_says_what_to_do_where_float16_convolutions_are_slow():
    fast = {"float32_ms": 1.0, "float16_ms": 2.0, "ratio": 2.0}
    slow = {"float32_ms": 0.57, "float16_ms": 31.97, "ratio": 56.1}
    assert env.convolution_note(fast, onednn=True) == "2x float32's time (2.00 against 1.00 ms)"
    assert "TF_ENABLE_ONEDNN_OPTS=0, set before TensorFlow starts" in env.convolution_note(slow, onednn=True)
    # With oneDNN already off there is no oneDNN remedy to offer: XLA or float32.
    off = env.convolution_note(slow, onednn=False)
    assert off.startswith("56.1x float32's time (31.97 against 0.57 ms): ") and "TF_ENABLE_ONEDNN_OPTS" not in off
    assert "XLA" in off
    failed = {"error": "NotFoundError: no kernel"}
    assert env.convolution_note(failed, onednn=True) == "could not run (NotFoundError: no kernel)"


# --- kmp demo --------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_trains():
    done = run_kmp("demo", "--epochs", "1")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("kmp demo: ")]
    # On a CPU the demo says once what its float16 costs and why it uses it, instead of warning against it.
    assert said[0] == cli._float16_note() and "Use 'float32'" not in done.stderr
    assert said[1].startswith("kmp demo: mixed_float16 on ") and "optimizer LossScaleOptimizer" in said[1]
    assert "loss scale from 2**16 (DeepSpeed's initial_scale_power 16), doubled after 25 clean steps" in said[2]
    values = dict(re.match(r"(\w[\w ]*?)\s{2,}(.*)", line).groups() for line in done.stdout.splitlines()
                  if line not in said)
    assert float(values["test accuracy"]) > 0.5  # one epoch; 10 classes: chance is 0.1
    assert float(values["loss scale"]) != 2.0**16  # 45 steps with a window of 25: the scale has moved
    assert values["update"] == "flat buffers (kmp.engine)"  # the demo runs kmp.prepare's engine


def test_the_demo_in_float32_warns_about_nothing(recwarn, capsys):
    assert cli.main(["demo", "--precision", "float32", "--epochs", "1"]) == 0
    assert "loss scale     none (float32 needs no loss scaling)" in capsys.readouterr().out
    assert [str(w.message) for w in recwarn if "/kmp/" in w.filename] == []


def test_the_demo_in_bfloat16_learns_from_float32_masters(capsys):
    """Its bfloat16 weights train on kmp.prepare's flat buffers from float32 masters (docs/precision.md): in
    bfloat16 itself, Keras's AdamW does not move them (test accuracy 0.08, chance)."""
    with pytest.warns(UserWarning, match="keeps the weights themselves in bfloat16"):
        assert cli.main(["demo", "--precision", "bfloat16", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    values = dict(re.match(r"(\w[\w ]*?)\s{2,}(.*)", line).groups() for line in out.splitlines()
                  if not line.startswith("kmp demo: "))
    assert values["update"] == "flat buffers (kmp.engine)" and float(values["test accuracy"]) > 0.5


@pytest.mark.parametrize("hardware, says", [
    (kmp.Hardware("cpu"), "kmp demo: mixed_float16 on CPU: CPUs have no fast float16 math; it runs slower than "
                          "float32. The demo uses it to show dynamic loss scaling"),
    (kmp.Hardware("gpu", (6, 1)), "kmp demo: mixed_float16 on GPU: compute capability (6, 1) has no Tensor Cores"),
    (kmp.Hardware("gpu", (8, 0)), None),
])
def test_the_demos_float16_note_is_kmp_envs_verdict(monkeypatch, hardware, says):
    monkeypatch.setattr(kmp.Hardware, "detect", classmethod(lambda cls: hardware))
    note = cli._float16_note()
    assert note == says if says is None else note.startswith(says) and "Use 'float32'" not in note


# --- kmp config check ----------------------------------------------------------

CORPUS = ROOT / "tests" / "data" / "deepspeed_configs"


def test_config_check_prints_the_resolved_job_without_tensorflow(tmp_path):
    path = CORPUS / "dse__QANet-Pytorch__ds_bsz512_1cycle.json"
    done, heavy = run_python(f"from kmp.cli.main import main\nraise SystemExit(main(['config', 'check', {str(path)!r}, "
                             "'--replicas', '2']))", tmp_path)
    assert heavy == [] and done.stderr == ""
    out = done.stdout
    assert "adam -> keras.optimizers.AdamW(learning_rate=0.001, beta_1=0.8" in out
    assert "OneCycle; lr at update k -> 0: 0.004" in out and "beta_1 at update k -> 0: 0.8" in out
    assert "train_batch_size 512 = micro 32 x 8 x 2 replicas" in out and out.rstrip().endswith("OK")


def test_config_check_says_once_what_a_compressed_optimizer_is_trained_as():
    from kmp.cli import config_check

    path = CORPUS / "dse__training__BingBertSquad__1-bit_adam__nccl__deepspeed_onebitadam_bsz96_config.json"
    report, code = config_check.check(str(path))
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["optimizer"])
    block = [lines[start]] + [line for line in lines[start + 1:start + 4] if line.split()[:1] == ["differs:"]]
    assert code == 0 and "onebitadam -> keras.optimizers.Adam(learning_rate=3e-05" in block[0]
    named = {name.lower() for line in block for name in re.findall(r"\b(adamw?|lamb)\b", line, re.IGNORECASE)}
    assert named == {"adam"}, block
    assert "from freeze_step (400) on" in block[1]


def test_config_check_exit_codes_for_ci(tmp_path):
    good = run_kmp("config", "check", str(CORPUS / "transformers__tests__deepspeed__ds_config_zero3.json"))
    assert good.returncode == 0 and "zero_optimization.stage is 3" in good.stdout
    template = CORPUS / "accelerate__tests__deepspeed__ds_config_zero2.json"
    unfilled = run_kmp("config", "check", str(template))
    assert unfilled.returncode == 1 and "optimizer.params.lr" in unfilled.stdout
    filled = run_kmp("config", "check", str(template), "--precision", "bf16", "--micro-batch-size", "4",
                     "--warmup-steps", "10", "--learning-rate", "2e-5", "--replicas", "2")
    assert filled.returncode == 1 and "gradient_clipping" in filled.stdout  # still one 'auto' nothing fills
    mismatch = tmp_path / "ds.json"
    mismatch.write_text('{"train_batch_size": 24, "train_micro_batch_size_per_gpu": 5, '
                        '"gradient_accumulation_steps": 2}')
    bad = run_kmp("config", "check", str(mismatch))
    assert bad.returncode == 1 and "INVALID" in bad.stdout and bad.stdout.rstrip().endswith("FAILED")
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"cuda_visible_devices": "0"}')
    assert run_kmp("config", "check", str(unknown)).returncode == 0
    assert run_kmp("config", "check", str(unknown), "--strict").returncode == 1


def test_config_check_fails_on_a_zero_block_deepspeed_would_refuse(tmp_path, capsys):
    path = tmp_path / "zero.json"
    path.write_text('{"zero_optimization": {"stage": 1, "reduce_bucket_sizee": 5, "overlap_comm": "yes", '
                    '"reduce_bucket_size": -5}}')
    for strict in ([], ["--strict"]):
        assert cli.main(["config", "check", str(path), *strict]) == 1
        out = capsys.readouterr().out
        assert "zero_optimization.reduce_bucket_sizee" in out and "Did you mean 'reduce_bucket_size'?" in out
        assert "zero_optimization.overlap_comm: expected true, false or null" in out
        assert "zero_optimization.reduce_bucket_size: expected an integer >= 0" in out


def test_config_check_notes_a_decay_shorter_than_warmup_once(tmp_path):
    from kmp.cli import config_check

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_num_steps": 100}}}))
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        report, code = config_check.check(str(path))
    assert code == 0 and escaped == []  # in the report, not also on stderr
    notes = [line for line in report.splitlines() if "total_num_steps (10) is less than warmup_num_steps (100)" in line]
    assert len(notes) == 1 and notes[0].split()[0] == "note", report


@pytest.mark.slow
def test_demo_feeds_the_configs_micro_batch(tmp_path, capsys):
    # The case: a global batch of 24 accumulated over 8 is a micro-batch of 3, not the demo's 32.
    # In this process, as the float32 demo above: test_demo_trains runs the command in a fresh one.
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 24, "gradient_accumulation_steps": 8}')
    assert cli.main(["demo", "--config", str(config), "--precision", "float32", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "the config's micro-batch 3, 8 per optimizer step" in out
    assert "skipped steps  0 of 60" in out  # 1,438 images / 3 per micro-batch / 8 per step
