"""kmp.callbacks.plot and `kmp demo --plot`: a real PNG of the run it claims to show."""

import contextlib
import io

import keras
import numpy as np
import pytest
from matplotlib import image, pyplot
from PIL import Image

import kmp
from kmp.cli import main as cli
from kmp.callbacks import LossScaleMonitor

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pixels(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return image.imread(str(path))  # H x W x 4 floats in [0, 1]


def _reddish(pixels) -> int:
    """Pixels of the overflow colour (#d62728), anti-aliasing allowed."""
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    return int(np.sum((r > 0.7) & (g < 0.3) & (b < 0.3)))


def test_the_demo_draws_its_run_and_writes_its_numbers_into_the_png(tmp_path):
    path = tmp_path / "run.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["demo", "--epochs", "3", "--plot", str(path)]) == 0
    printed = dict(line.split(None, 1) if " " in line else (line, "") for line in out.getvalue().splitlines())
    pixels = _pixels(path)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 400
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50  # lines, text, axes: not blank
    text = Image.open(path).text
    # 1438 digits in batches of 32 (the demo's default): 45 steps per epoch.
    assert text["kmp.steps"] == "135"
    assert printed["loss"].split() == ["scale", text["kmp.final_loss_scale"]]
    skipped = printed["skipped"].split()  # "steps  N of M"
    assert skipped[1] == text["kmp.skipped_steps"]
    assert len(text["kmp.overflow_steps"].split()) == int(text["kmp.skipped_steps"])
    # What the demo is for: from 2**16 with a window of 25 the scale grows until float16 overflows, then halves.
    assert int(text["kmp.skipped_steps"]) >= 1 and int(text["kmp.final_loss_scale"]) > 2**16


def test_skipped_steps_are_marked(tmp_path):
    """fp16 from a scale of 2**24: the first steps overflow and are skipped."""
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), initial_scale=2.0**24, log_overflows=False),
                  loss="mse")
    recorder = kmp.StepRecorder()
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[recorder, LossScaleMonitor()])
    skipped = int(model.optimizer.skipped_steps.numpy())
    assert skipped > 0
    numbers = kmp.plot_run(recorder.steps, tmp_path / "overflow.png")
    text = Image.open(tmp_path / "overflow.png").text
    assert text == {**text, **numbers}
    assert int(text["kmp.skipped_steps"]) == skipped == len(text["kmp.overflow_steps"].split())
    assert text["kmp.final_loss_scale"] == f"{float(model.optimizer.dynamic_scale.numpy()):.10g}"
    with_marks = _reddish(_pixels(tmp_path / "overflow.png"))
    # The same run with no overflow recorded: no red marks or lines, only the flat red "skipped" curve.
    clean = [{**s, "skipped_steps": 0.0} for s in recorder.steps]
    kmp.plot_run(clean, tmp_path / "clean.png")
    assert with_marks > _reddish(_pixels(tmp_path / "clean.png")) + 50


def _orange(pixels) -> int:
    """Pixels of the replay colour (#ff7f0e), anti-aliasing allowed."""
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    return int(np.sum((r > 0.85) & (g > 0.35) & (g < 0.65) & (b < 0.25)))


def test_replayed_steps_are_marked_apart_from_skipped_ones(tmp_path):
    """overflow="replay" from 2**17: the first step overflows and is replayed (orange), none skipped (red)."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(96, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), initial_scale=2.0**17, overflow="replay",
                                     log_overflows=False), loss="mse")
    kmp.prepare(model)
    recorder = kmp.StepRecorder()
    model.fit(x, np.full((96, 1), 10.0, "float32"), batch_size=8, verbose=0, callbacks=[recorder, LossScaleMonitor()])
    numbers = kmp.plot_run(recorder.steps, tmp_path / "replay.png")
    assert numbers["kmp.replayed_steps"] == "1" and numbers["kmp.replay_steps"] == "1"
    assert numbers["kmp.skipped_steps"] == "0" and numbers["kmp.overflow_steps"] == ""
    # The loss panel (the top third): its orange circle at the replayed step, gone when nothing was replayed.
    marked = _pixels(tmp_path / "replay.png")
    unreplayed = [{**s, "replayed_steps": 0.0} for s in recorder.steps]
    kmp.plot_run(unreplayed, tmp_path / "none.png")
    clean = _pixels(tmp_path / "none.png")
    top = marked.shape[0] // 3
    assert _orange(marked[:top]) > _orange(clean[:top]) + 20
    assert _reddish(marked[:top]) == _reddish(clean[:top])  # no skipped-step cross


@pytest.mark.parametrize("skips", [[0, 0, 0, 0], [0, 1, 1, 2], [0, 3, 7, 13]])
def test_the_skipped_steps_axis_counts_in_whole_steps(tmp_path, monkeypatch, skips):
    figures, close = [], pyplot.close
    monkeypatch.setattr(pyplot, "close", figures.append)  # keep the figure open to read its axes
    steps = [{"step": i + 1, "epoch": 0, "loss": 1.0 / (i + 1), "loss_scale": 2.0**16, "skipped_steps": float(n)}
             for i, n in enumerate(skips)]
    kmp.plot_run(steps, tmp_path / "run.png")
    axis = figures[0].axes[2]
    low, high = axis.get_ylim()
    shown = [t for t in axis.get_yticks() if low <= t <= high]
    close(figures[0])
    assert all(float(t).is_integer() for t in shown) and len(shown) >= 2
    assert -1 < low <= 0 and max(skips) <= high < max(skips) + 2  # 0 skips: 0..1, not -0.04..0.04


def test_no_steps_is_a_clear_error(tmp_path):
    with pytest.raises(kmp.KmpError, match="Received: no steps"):
        kmp.plot_run([], tmp_path / "x.png")
