"""`kmp bench [--quick]`: the P1-P4, P6 and memory comparisons of benchmarks/ on this machine, kmp vs stock Keras.

Each comparison is one of the project's benchmark scripts, run as it is in
its own process (a fresh TensorFlow runtime each: P1 and P6 split the CPU into
two logical devices, P4 starts two workers), with its output, the tables of
benchmarks/, streamed as it comes:

    P1, P2  p1_p2_step_time.py       ms per step of the issues' MLP, mixed_float16:
                                     kmp vs Keras under MirroredStrategy and on one
                                     device; dynamic vs static loss scale
    P3      p3_fused_bandwidth.py    the Adam update vs a flat copy's bandwidth
    P4      p4_accumulation_allreduce.py
                                     accumulation under MultiWorkerMirroredStrategy
                                     (2 local workers): one all-reduce per window vs
                                     one per micro-batch
    P6      p6_transformer.py        a keras-hub GPT-2 (4 layers, 256 wide, sequence
                                     128), float32 and mixed_float16: kmp vs Keras
                                     under MirroredStrategy and on one device with XLA
    MEM     memory.py                peak resident memory of a keras-hub GPT-2 at two sizes,
                                     each configuration in its own process: stock Keras
                                     and kmp on every path (per variable, flat buffers,
                                     ZeRO-1, 8-bit states), one device and MirroredStrategy

`--quick` runs fewer rounds and steps, P3 on its bandwidth-bound layout only,
P6 at mixed_float16 only, and MEM at the small size on six configurations
(about 5 minutes for P1-P4 on 2 cores, 3 for P6, most of it building and
compiling its models, and 6 for MEM; the medians are
noisier). The scripts live in benchmarks/ of a checkout; an
installed kmp carries them in `<prefix>/share/kmp/benchmarks` (setup.cfg's
data_files). They measure the kmp they import: the checkout's, else the
installed one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from kmp.errors import KmpError

# (name, script, arguments, --quick arguments)
COMPARISONS = (
    ("P1, P2: step time, kmp vs Keras", "p1_p2_step_time.py", [], ["--rounds", "2", "--steps", "10"]),
    ("P3: the fused update vs memory bandwidth", "p3_fused_bandwidth.py", [], ["--quick", "--bandwidth-only"]),
    ("P4: accumulation under MultiWorkerMirroredStrategy", "p4_accumulation_allreduce.py", [],
     ["--rounds", "1", "--windows", "2"]),
    ("P6: a keras-hub GPT-2, kmp vs Keras", "p6_transformer.py", [], ["--quick", "--precisions", "mixed_float16"]),
    ("MEM: memory as the process holds it, kmp vs Keras", "memory.py", [],
     ["--sizes", "small", "--only", "stock,kmp,stock-mirrored,kmp-mirrored,zero1-mirrored,8bit-mirrored"]),
)


def scripts_directory() -> Path:
    """benchmarks/ of the checkout kmp runs from, else the installed copy."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"  # kmp/cli/ -> the checkout
    installed = Path(sysconfig.get_path("data")) / "share" / "kmp" / "benchmarks"
    for candidate in (here, installed):
        if (candidate / COMPARISONS[0][1]).is_file():
            return candidate
    raise KmpError(f"kmp bench: expected the benchmark scripts in {here} or {installed}. Received: neither has "
                   f"{COMPARISONS[0][1]}. Reinstall kmp (pip install .) from a checkout.")


def run(quick: bool = False, only: str | None = None) -> int:
    """Runs the comparisons in turn; the first failing script's exit status, else 0."""
    directory = scripts_directory()
    chosen = [c for c in COMPARISONS if only is None or only.upper() in c[0]]
    if not chosen:
        raise KmpError(f"kmp bench: expected --only to name one of P1, P2, P3, P4, P6, MEM. Received: {only!r}.")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    for title, script, arguments, quick_arguments in chosen:
        command = [sys.executable, str(directory / script), *(quick_arguments if quick else arguments)]
        print(f"\n=== {title} ({script} {' '.join(command[2:])})", flush=True)
        start = time.perf_counter()
        code = subprocess.call(command, env=env, cwd=directory)
        print(f"=== {script}: {time.perf_counter() - start:.0f} s, exit status {code}", flush=True)
        if code:
            return code
    return 0
