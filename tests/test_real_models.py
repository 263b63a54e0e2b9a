"""Real models (tests/real_models.py: keras-hub task models, keras.applications
networks, a model with its own train_step, a GAN) trained under kmp.wrap +
kmp.prepare on the paths users take, against stock Keras.

Each case trains STEPS steps and must show: no crash; finite losses; each
step's loss within the axis's tolerance of stock Keras at the same precision
on one device (fp16: Keras's LossScaleOptimizer, with XLA, or without where
kmp's step runs TensorFlow's kernels, real_models.Case; bf16: float32; a model with
BatchNormalization on several replicas: under the same strategy, see
real_models.reference); the same skipped steps as stock, within one; trained
weights as stock's (tests/parity.py: they lie within a fraction of stock's
update from stock's, where an untrained run lies the whole update away, and
stock's moved); a `.keras` file that loads (kmp imported) and takes one more
step equal to the live model's (but for the cases real_models.CASES and
NO_RELOAD say why not); and the path kmp took, listed at the end of the run's
output (tests/conftest.py).

The cases are measured in fresh processes (tests/real_model_worker.py local;
the measuring is tests/real_models.measure), and asserted here: XLA's
compilation cache is never freed, and the conv nets' executables made the
suite's processes grow past 13 GB. A conv net's cases that share a reference
get a process of their own, without oneDNN (_env); the light models share two (_group).

The matrix is a selection that keeps the suite's time in check: every
model at fp16 on one device (keras-hub's Mixtral at float32: see MATRIX),
and each other axis on models of different kinds, on the flat engine and
the per-variable path; two MultiWorkerMirroredStrategy workers train two
models at the end. Tolerances, rtol on each step's loss, and on the trained
weights, of stock's update (real_models.AXES):
- fp16 against Keras's fp16: 1e-2 and 1e-2. Both keep float32 masters and take
  the same loss scale; what differs is the order of float32 sums (the
  all-reduce, the fused update's FMA), about 1e-4 after a few steps.
- bf16 against float32: 3e-2 and 0.15. bfloat16 keeps 8 bits of mantissa: the
  activations' rounding alone moves a tiny model's loss by up to ~1%, and its
  weights by 2.5-6.6% of the update (GPT-2, ViT, the GAN).
- 8-bit states against 32-bit Keras fp16: 3e-2 and 5e-2. The moments are
  quantized (docs/eight-bit.md); the first steps move a little differently.
- The weights where an embedding's gradient is sparse and kmp adds its rows
  before squaring them (real_models.Case.sparse_embedding): 0.3.
- Below MATRIX: what was measured where a model amplifies the kernels' rounding.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras_hub  # noqa: F401 - the test extra: without it the matrix fails, never skips
import numpy as np
import pytest

import parity
import real_models
from real_models import AXES, CASES

pytestmark = pytest.mark.slow

# Every model at fp16 on one device; each other axis on each path, on models of different kinds. A
# second model on an axis and path only where it brings what the first does not: BatchNormalization
# on replicas, a model's own train_step.
# keras-hub 0.32's mixture-of-experts models (Mixtral, Qwen3-MoE) fail in mixed precision
# under stock Keras (their load-balancing loss multiplies float16 by float32): float32 only.
MATRIX = [
    *[(name, "fp16", "flat") for name in ("gpt2", "bert", "llama", "vit", "bart", "mobilenetv3small",
                                          "efficientnetv2b0")],
    *[(name, "fp16", "per-variable") for name in ("resnet50v2", "own_step", "gan")],
    ("mixtral", "fp32", "per-variable"), ("mixtral", "fp32 mirrored", "flat"),
    ("gpt2", "bf16 mirrored", "flat"),
    ("llama", "bf16 mirrored", "per-variable"), ("gan", "bf16 mirrored", "per-variable"),
    ("bert", "fp16 mirrored", "flat"), ("mobilenetv3small", "fp16 mirrored", "flat without XLA"),
    ("own_step", "fp16 mirrored", "per-variable"),
    ("gpt2", "accumulation 2 + clipping", "flat"), ("bert", "accumulation 2 + clipping", "per-variable"),
    ("vit", "zero 1", "flat"),
    ("gpt2", "8-bit states", "flat"), ("bert", "8-bit states", "per-variable"),
]

# Where kmp's step and the reference could run float16 through different kernels (XLA's, TensorFlow's),
# BatchNormalization amplifies their rounding (measured without oneDNN, as these cases run: see _env), so
# both run the same ones:
# - ResNet50V2 on the per-variable path (no XLA on one device): the reference without XLA too
#   (real_models.CASES). Against Keras's XLA step its trained weights were 74% of the update apart.
# - MobileNetV3Small on two replicas, where stock Keras runs without XLA (its XLA step fails under a
#   strategy): kmp's step without XLA too ("flat without XLA"). With XLA per replica its first loss, before
#   any update, was 0.12% apart and its weights 26% of the update apart. With the same kernels what differs
#   is the order of the all-reduce's and the update's sums, which the model amplifies: its weights 8%
#   of the update apart (_WEIGHTS_LOOSER), its third loss 0.4%.
# EfficientNetV2B0's gradients overflow float16 from 2^15, from 2^8 and from 1 (its first step), in stock
# Keras and in kmp alike: its case compares the forward passes, the skips, and weights left as they were.
_WEIGHTS_LOOSER = {("mobilenetv3small", "fp16 mirrored"): 0.25}

ROOT = Path(__file__).resolve().parent.parent
_MEASURED = {}


def _env(onednn=True):
    """A worker process's environment: this checkout's kmp and tests importable, TF's start-up lines
    off (XLA_FLAGS, for cheap compiles, comes from tests/conftest.py).

    Without oneDNN, for the conv nets. Where their float16 convolution gradients run outside XLA
    (ResNet50V2's per-variable path; stock Keras under a strategy), oneDNN takes its reference kernel on
    some CPUs (`kmp env` says where), ~15x float32's time: TensorFlow's own kernels take ~30 s of CPU
    less. And they round as XLA's do: MobileNetV3Small's third loss under a strategy with oneDNN's is
    6% from kmp's (XLA per replica), with TensorFlow's 0.4% (BatchNormalization amplifies rounding).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if not onednn:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return env


def _run(specs, directory, onednn=True):
    """tests/real_model_worker.py local on `specs`, in a fresh process: its results by spec."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "specs.json").write_text(json.dumps(specs))
    out, log = directory / "results.json", directory / "worker.log"
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.call([sys.executable, str(ROOT / "tests" / "real_model_worker.py"), "local", str(out),
                                str(directory / "specs.json")], stdout=f, stderr=subprocess.STDOUT, env=_env(onednn),
                               cwd=ROOT, timeout=3600)
    results = json.loads(out.read_text()) if out.exists() else {}
    if code != 0 and len(results) < len(specs):
        pytest.fail(f"the worker exited with {code}:\n" + log.read_text()[-3000:])
    return results


# The light models (transformers, the small step and GAN models) share two processes: each new
# process costs seconds of CPU to import TensorFlow and keras-hub, more than most of their cases.
_SHARED = {"gpt2": "light-1", "bert": "light-1", "bart": "light-1", "gan": "light-1",
           "llama": "light-2", "vit": "light-2", "mixtral": "light-2", "own_step": "light-2"}


def _group(name, axis_name) -> str:
    """The cases measured in one process: a conv net's cases that share stock Keras's reference (their
    XLA executables are large), or all of a light model's."""
    if name in _SHARED:
        return _SHARED[name]
    return "-".join(map(str, real_models.reference_key(CASES[name], AXES[axis_name])))


def _measured(name, axis_name, path, tmp_path_factory):
    """The case's measurements; the first case of its group measures the whole group."""
    group = _group(name, axis_name)
    if group not in _MEASURED:
        _MEASURED[group] = "not measured: its group's worker failed (see the group's first case)"
        specs = [list(c) for c in MATRIX if _group(*c[:2]) == group]
        conv_net = name not in _SHARED  # its process runs without oneDNN (_env)
        _MEASURED[group] = _run(specs, tmp_path_factory.mktemp(name), onednn=not conv_net)
    results = _MEASURED[group]
    if isinstance(results, str):
        pytest.fail(results)
    result = results["|".join((name, axis_name, path))]
    if "error" in result:
        pytest.fail(result["error"])
    return result


# The conv nets first: their XLA compiles are the suite's longest (tests/conftest.py puts this file first).
@pytest.mark.parametrize("name, axis_name, path", [
    pytest.param(*c, id="-".join(c).replace(" ", "_"), marks=pytest.mark.xdist_group(_group(*c[:2])))
    for c in sorted(MATRIX, key=lambda c: not CASES[c[0]].batch_norm)])
def test_a_real_model_trains_as_under_stock_keras(name, axis_name, path, tmp_path_factory, record_property):
    axis = AXES[axis_name]
    result = _measured(name, axis_name, path, tmp_path_factory)
    losses = result["losses"]
    record_property(real_models.PATH_TAKEN, f"{name} / {axis_name} / {path} asked: {result['path']}; "
                                            f"losses {np.round(losses, 4).tolist()}; weights "
                                            f"{result['apart'] / (result['moved'] or 1):.2g} of stock's update apart")
    assert np.all(np.isfinite(losses)), losses
    np.testing.assert_allclose(losses, result["reference"], rtol=axis.rtol)
    assert abs(result["skipped"] - result["reference_skipped"]) <= 1
    if CASES[name].overflows:  # no update to compare (real_models.CASES)
        assert result["reference_skipped"] == real_models.STEPS, "its steps train now: set overflows=False"
        assert result["moved"] == result["apart"] == 0, "every step skipped, yet the weights moved"
    else:
        parity.check_gap(result["moved"], result["apart"], _weights_rtol(name, axis_name, path))
    if real_models.PATHS[path]["flat_buffers"] and not CASES[name].own_step:
        assert result["flat"], result["path"]
    assert result["reload"] is None, result["reload"]


def _weights_rtol(name, axis_name, path) -> float:
    """The axis's tolerance on the trained weights; an embedding's sparse gradient where kmp adds its rows first
    (real_models.Case.sparse_embedding): 0.3 (0.13 measured, Llama on the flat buffers)."""
    axis = AXES[axis_name]
    if CASES[name].sparse_embedding and (real_models.PATHS[path]["flat_buffers"] or ("states", "8bit") in axis.wrap):
        return 0.3
    return _WEIGHTS_LOOSER.get((name, axis_name), axis.weights_rtol)


# --- Two MultiWorkerMirroredStrategy workers (processes on 127.0.0.1) ---

MULTI_WORKER = [("gpt2", "fp16 mirrored", "flat"), ("vit", "bf16 mirrored", "per-variable")]


@pytest.mark.xdist_group("two workers")
def test_real_models_train_on_two_workers(tmp_path, record_property):
    from kmp.cli.launch import LocalJob

    specs = [f"{name}:{AXES[axis].policy}:{path}" for name, axis, path in MULTI_WORKER]
    worker = ROOT / "tests" / "real_model_worker.py"
    job = LocalJob(lambda i: [sys.executable, str(worker), "workers", str(tmp_path / f"worker{i}.json"), *specs], 2,
                   env=_env(), cwd=ROOT, log_dir=tmp_path, threads=False)
    with job:
        codes = job.wait(timeout=900)
    if codes != [0, 0]:
        pytest.fail("\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(2)))
    results = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    # Stock Keras on one device.
    references = _run([[name, axis, None] for name, axis, _ in MULTI_WORKER], tmp_path / "references")
    for (name, axis_name, path), spec in zip(MULTI_WORKER, specs):
        first, second = results[0][spec], results[1][spec]
        reference = references["|".join((name, axis_name, "reference"))]
        assert "error" not in reference, reference.get("error")
        stock = real_models.load_weights(reference["weights"])
        trained = [real_models.load_weights(worker[spec]["weights"])["trained"] for worker in results]
        moved, apart = parity.update_gap(stock["initial"], stock["trained"], trained[0])
        record_property(real_models.PATH_TAKEN, f"{name} / two workers, {AXES[axis_name].policy} / {path} asked: "
                                                f"{first['path']}; losses {np.round(first['losses'], 4).tolist()}; "
                                                f"weights {apart / (moved or 1):.2g} of stock's update apart")
        assert first["replicas"] == 2
        np.testing.assert_allclose(first["losses"], second["losses"], rtol=1e-6)  # one loss, every worker
        for a, b in zip(*trained):  # one model, every worker
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(first["losses"], reference["reference"], rtol=AXES[axis_name].rtol)
        assert abs(first["skipped"] - reference["reference_skipped"]) <= 1
        parity.check_gap(moved, apart, _weights_rtol(name, axis_name, path))
        if path == "flat":
            assert first["path"].startswith("flat buffers"), first["path"]
