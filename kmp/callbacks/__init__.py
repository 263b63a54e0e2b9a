"""kmp.callbacks: the Keras callbacks users pass to fit().

    monitor.py  LossScaleMonitor, GradientAccumulationScheduler
    backup.py   BackupAndRestore: Keras's, plus kmp's optimizer and flat-buffer state
    plot.py     StepRecorder and plot_run (`kmp demo --plot`)

The top of kmp's layers: these modules may import any kmp module but the CLI,
and nothing below imports them (kmp.engine knows kmp's callbacks by module
name). The public callbacks are imported here, so `kmp.callbacks.X` works.
"""

from kmp.callbacks.backup import BackupAndRestore
from kmp.callbacks.monitor import GradientAccumulationScheduler, LossScaleMonitor

__all__ = ["BackupAndRestore", "GradientAccumulationScheduler", "LossScaleMonitor"]
