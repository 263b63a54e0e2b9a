"""Test setup shared by the whole suite.

Two logical CPU devices are configured before TensorFlow initializes its
runtime, so MirroredStrategy tests run for real on this machine.
"""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _cheap_xla_compiles(flags: str) -> str:
    """XLA_FLAGS that make XLA's CPU compiles about 3x cheaper, for this process and every child.

    Each test's programs run a few steps, while a conv net's compile costs tens of seconds:
    the LLVM back end unoptimized, and XLA's older loop emitters (its MLIR fusion emitters
    take three times the CPU to compile at that level), and one LLVM module per program (split
    for parallel codegen, it costs ~5% more CPU on two cores). Programs run 2-3x slower. kmp
    and stock Keras are compiled alike; a setting the caller gives is kept.
    """
    for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1"):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    return flags


os.environ["XLA_FLAGS"] = _cheap_xla_compiles(os.environ.get("XLA_FLAGS", ""))

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


# TensorFlow's and Keras's own objects, made at import, are never garbage: a
# full collection (below) then does not walk them again each time.
gc.freeze()


@pytest.fixture(autouse=True)
def _free_distributed_iterators_young(request):
    """A full garbage collection after each test on two replicas.

    A fit() that ends early (an exception, a callback's interrupt) leaves
    Keras's epoch generator suspended, in a reference cycle that holds
    tf.distribute's MultiDeviceIterator, until a full collection minutes
    later. Freeing it then blocks until its tf.data autotune thread wakes:
    TensorFlow's cancellation notifies that thread before it marks itself
    cancelled, so the thread sleeps out its period, which has grown to up to
    60 s (tensorflow/core/framework/model.cc, OptimizeLoop;
    xla/tsl/framework/cancellation.cc, StartCancelWithStatus). The suite
    stood idle 75-195 s at a time for it. Collected after the test, the
    iterator is young and its period short.

    What survives is then frozen, so that the next full collection walks only
    what later tests made: unfrozen, each took about 0.6 s of CPU, and grew with
    the heap the suite's earlier tests left. Reference counting still frees
    frozen objects, but a frozen cycle dropped later stays in memory: a
    bounded cost in a test process. What it holds stays alive too (an input
    iterator kmp's releaser then holds for good): a test does not assert on
    such process-wide state that earlier tests on its worker may have left.
    """
    yield
    if "two_replicas" in request.fixturenames:
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Tests that set the global dtype policy or float type never leak it."""
    policy = keras.config.dtype_policy()
    floatx = keras.config.floatx()
    yield
    keras.config.set_dtype_policy(policy)
    keras.config.set_floatx(floatx)


@pytest.fixture(scope="session")
def two_replicas():
    """MirroredStrategy over the two logical CPU devices.

    One per session: separate MirroredStrategy objects in one process reuse
    collective instance keys, and a later one's all-reduce can then meet an
    earlier one's tensors ("Shape mismatch in the collective instance").
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def pytest_collection_modifyitems(items):
    """The longest groups first (the real-model matrix, then the other slow tests): the xdist
    workers then fill the rest of the run with short tests instead of ending on one long group."""
    def rank(item):
        return 0 if item.nodeid.startswith("tests/test_real_models.py") else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


def pytest_terminal_summary(terminalreporter):
    """The real-model matrix (tests/test_real_models.py): each case's path and losses, in every run's output.

    Recorded as a user property, which reaches this process from xdist's workers.
    """
    from real_models import PATH_TAKEN

    rows = [value for reports in terminalreporter.stats.values() for report in reports
            for key, value in getattr(report, "user_properties", ()) if key == PATH_TAKEN]
    if rows:
        terminalreporter.section("real models: the path kmp took")
        for row in sorted(set(rows)):
            terminalreporter.line(row)
