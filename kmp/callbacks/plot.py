"""One picture of a run: loss, loss scale, and skipped and replayed steps against the step.

    recorder = kmp.callbacks.plot.StepRecorder()
    model.fit(..., callbacks=[kmp.callbacks.LossScaleMonitor(), recorder])
    kmp.plot_run(recorder.steps, "run.png")      # `kmp demo --plot run.png` does this

Three panels share the step axis:

    loss         as Keras logs it per batch: the running mean since the epoch began
                 (dotted lines: epoch starts), log scale; a red cross at each
                 skipped (overflow) step, an orange circle at each replayed one
                 (overflow="replay": recomputed at a lowered scale and applied)
    loss scale   the scale after each step, log2 axis: the halvings at overflows,
                 the doublings every loss_scale_window clean steps
    steps        skipped steps so far (kmp's counter), and replayed steps so far where
                 the optimizer replays

The run's numbers are also written into the PNG's text chunks (`kmp.steps`,
`kmp.final_loss`, `kmp.final_loss_scale`, `kmp.skipped_steps`,
`kmp.overflow_steps`, and where replayed: `kmp.replayed_steps`, `kmp.replay_steps`), so a file can be matched with the run it shows.

matplotlib is an extra (`pip install "kmp[plot]"`), imported only here and
only when drawing; the Agg backend draws without a screen.
"""

from __future__ import annotations

import math
import os

import keras

from kmp.errors import KmpError

OVERFLOW_COLOR = "#d62728"
REPLAY_COLOR = "#ff7f0e"


class StepRecorder(keras.callbacks.Callback):
    """Records each training step's loss, loss scale, and skipped- and replayed-step counts from the logs.

    The loss-scale values come from `kmp.callbacks.LossScaleMonitor` (anywhere
    in the callback list); without it only the loss is recorded.
    """

    kmp_reads_weights = False  # reads the logs only: the flat-buffer engine copies nothing for it

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        k = int(getattr(self.model, "steps_per_execution", 1) or 1)  # one call per execution of k steps
        record = {"step": (self.steps[-1]["step"] if self.steps else 0) + k, "epoch": self._epoch,
                  "loss": float(logs.get("loss", math.nan))}
        for key in ("loss_scale", "skipped_steps", "replayed_steps"):
            if key in logs:
                record[key] = float(logs[key])
        self.steps.append(record)


def plot_run(steps: list[dict], path: str | os.PathLike, title: str = "kmp run") -> dict:
    """Draws `steps` (StepRecorder.steps, or dicts with step, loss and optionally
    loss_scale, skipped_steps, replayed_steps) into the PNG at `path`; returns the numbers written into it."""
    if not steps:
        raise KmpError("kmp.plot_run: expected the recorded steps of a run (StepRecorder.steps). Received: no steps. "
                       "Pass the recorder to fit() and plot after it.")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot, ticker
    except ImportError:
        raise KmpError('Drawing the run needs matplotlib, an extra: pip install "kmp[plot]".') from None
    x = [s["step"] for s in steps]
    skipped = [s.get("skipped_steps") for s in steps]
    overflow_at = _increased(steps, "skipped_steps")
    replayed_at = _increased(steps, "replayed_steps")
    replays = "replayed_steps" in steps[-1]
    numbers = {
        "kmp.steps": str(x[-1]),
        "kmp.final_loss": f"{steps[-1]['loss']:.6g}",
        "kmp.final_loss_scale": f"{steps[-1].get('loss_scale', math.nan):.10g}",  # 1048576, not 1.04858e+06
        "kmp.skipped_steps": str(int(skipped[-1])) if skipped[-1] is not None else "n/a",
        "kmp.overflow_steps": " ".join(str(s) for s in overflow_at),
    }
    if replays:
        numbers["kmp.replayed_steps"] = str(int(steps[-1]["replayed_steps"]))
        numbers["kmp.replay_steps"] = " ".join(str(s) for s in replayed_at)
    scaled = "loss_scale" in steps[-1]
    figure, axes = pyplot.subplots(3 if scaled else 1, 1, sharex=True, figsize=(8, 7 if scaled else 3), squeeze=False)
    axes = axes[:, 0]
    loss = [s["loss"] for s in steps]
    axes[0].plot(x, loss, color="#1f77b4", linewidth=1.2)
    axes[0].set_yscale("log" if min(loss) > 0 else "linear")
    axes[0].set_ylabel("loss (epoch's running mean)")
    starts = [s["step"] for s, before in zip(steps[1:], steps) if s.get("epoch", 0) != before.get("epoch", 0)]
    for step in starts:
        for ax in axes:
            ax.axvline(step, color="#7f7f7f", linestyle=":", linewidth=0.8)
    by_step = dict(zip(x, loss))
    if overflow_at:
        axes[0].scatter(overflow_at, [by_step[s] for s in overflow_at], color=OVERFLOW_COLOR, marker="x", zorder=3,
                        label=f"skipped step ({len(overflow_at)})")
    if replayed_at:
        axes[0].scatter(replayed_at, [by_step[s] for s in replayed_at], facecolors="none", edgecolors=REPLAY_COLOR,
                        marker="o", zorder=3, label=f"replayed step ({len(replayed_at)})")
    if overflow_at or replayed_at:
        axes[0].legend(loc="upper right")
    if scaled:
        axes[1].step(x, [s["loss_scale"] for s in steps], where="post", color="#2ca02c", linewidth=1.2)
        axes[1].set_yscale("log", base=2)
        axes[1].set_ylabel("loss scale")
        axes[2].step(x, [s.get("skipped_steps", 0.0) for s in steps], where="post", color=OVERFLOW_COLOR,
                     linewidth=1.2, label="skipped")
        if replays:
            axes[2].step(x, [s.get("replayed_steps", 0.0) for s in steps], where="post", color=REPLAY_COLOR,
                         linewidth=1.2, label="replayed")
            axes[2].legend(loc="upper left")
        axes[2].set_ylabel("skipped / replayed steps" if replays else "skipped steps")
        # A count: integer ticks, and at least 0..1 so a run without skips is not drawn on -0.04..0.04.
        top = max(1.0, max(max(s.get("skipped_steps", 0.0), s.get("replayed_steps", 0.0)) for s in steps))
        axes[2].set_ylim(-0.05 * top, 1.05 * top)
        axes[2].yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        for step in overflow_at:
            for ax in axes[1:]:
                ax.axvline(step, color=OVERFLOW_COLOR, alpha=0.25, linewidth=0.8)
        for step in replayed_at:
            for ax in axes[1:]:
                ax.axvline(step, color=REPLAY_COLOR, alpha=0.25, linewidth=0.8, linestyle="--")
    axes[-1].set_xlabel("step")
    replayed = f"{numbers['kmp.replayed_steps']} replayed, " if replays else ""
    axes[0].set_title(f"{title}: {numbers['kmp.steps']} steps, {numbers['kmp.skipped_steps']} skipped, {replayed}"
                      f"final loss scale {numbers['kmp.final_loss_scale']}")
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png", dpi=100, metadata=numbers)
    pyplot.close(figure)
    return numbers


def _increased(steps: list[dict], key: str) -> list:
    """The steps after which the count `key` went up (a skipped or a replayed step)."""
    counts = [s.get(key) for s in steps]
    return [s["step"] for s, before in zip(steps, [0.0] + counts[:-1])
            if s.get(key) is not None and s[key] > (before or 0.0)]
