"""Variants in worker processes, timed in interleaved rounds, under time and memory limits.

Some variants cannot be trusted to finish: stock Keras's whole-step XLA on a
model of 1000 small variables compiled for 40 minutes and filled 24 GiB on
this machine. So each variant runs in its own process, and only one
computes at a time (the others wait on their stdin):

    for each resident variant (the references), one at a time:
        start its worker; it builds the model and times its first call
        (trace + compile) alone
        past the wall-clock limit, its RSS past the memory limit, or the
        machine's available memory below a floor:
            kill it; the row says "did not finish" and why
    for each other variant, one at a time:
        build it alone, as above
        warm-up round, then `rounds` rounds:  # as common.interleaved
            it and each resident worker measure once (ms), in turn
        end its worker
    (with every variant resident: one warm-up round and `rounds` rounds of all)

The non-resident rows are for workers that hold gigabytes once built
(a traced step of 2000 variables held 4-7 GiB here): each shares the
machine with the references only, and each is timed interleaved with them,
so its ratio to a reference is measured side by side. The parent imports
no TensorFlow.

Worker protocol (stdout lines starting with "@@"; anything else printed is
passed on to stderr): `@@ready <first-call seconds>` once built, then one
`@@ms <value>` per `measure` line read from stdin, and `@@note <text>` for
`note`. A script serves its variants with `serve(build)`, where
`build()` returns `(first_call_seconds, measure, note)`: `measure()` gives
milliseconds, `note()` a short text for the report (or "").
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

# Benchmark the kmp of this checkout: a script's own folder (benchmarks/) is
# first on sys.path and the checkout's root is not, so an installed kmp (an
# older copy, here) would be imported instead.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GIB = 1024**3
PREFIX = "@@"


@dataclass
class Variant:
    argv: list[str]  # the worker's command line
    build_limit: float  # seconds for start-up, build and the first call


@dataclass
class Outcome:
    first: float | None = None  # seconds of the first call (trace + compile)
    times: list[float] = field(default_factory=list)  # ms, one per recorded round
    failure: str | None = None  # why there are no (more) times
    peak_rss: float = 0.0  # GiB, the worker and its children, as sampled
    note: str = ""
    built_in: float = 0.0  # wall seconds from start to ready


def serve(build) -> None:
    """The worker's side: build, report the first call, then measure on request."""
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not break the protocol
    first, measure, note = build()
    print(f"{PREFIX}ready {first}", file=out, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "measure":
            print(f"{PREFIX}ms {measure()}", file=out, flush=True)
        elif command == "note":
            print(f"{PREFIX}note {note()}", file=out, flush=True)
        elif command == "quit":
            break


class _Worker:
    def __init__(self, argv):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                self.lines.put(line[len(PREFIX):].strip())
            else:
                sys.stderr.write(line)
        self.lines.put(None)  # end of output

    def rss(self) -> float:
        try:
            process = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / GIB
        except psutil.NoSuchProcess:
            return 0.0

    def send(self, command):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def reply(self, outcome: Outcome, limit: float, rss_limit: float, floor: float, what: str) -> str | None:
        """The next protocol line, or None after recording in `outcome` why there is none."""
        start = time.perf_counter()
        while True:
            outcome.peak_rss = max(outcome.peak_rss, self.rss())
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:
                self.process.wait()
                outcome.failure = f"exited with code {self.process.returncode} during {what}"
                return None
            if line:
                return line
            waited = time.perf_counter() - start
            if waited > limit:
                outcome.failure = (f"did not finish {what} in {limit:.0f} s "
                                   f"(killed; peak RSS {outcome.peak_rss:.1f} GiB)")
            elif outcome.peak_rss > rss_limit:
                outcome.failure = (f"stopped at RSS {outcome.peak_rss:.1f} GiB > {rss_limit:.0f} GiB "
                                   f"after {waited:.0f} s of {what} (killed)")
            elif psutil.virtual_memory().available / GIB < floor:
                outcome.failure = (f"stopped after {waited:.0f} s of {what}: the machine had less than {floor:.0f} "
                                   f"GiB available (killed at RSS {outcome.peak_rss:.1f} GiB)")
            else:
                continue
            self.kill()
            return None

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def run(variants: dict[str, Variant], rounds: int, *, resident=None, rss_limit_gib: float = 16.0,
        memory_floor_gib: float = 2.0, round_limit: float = 600.0, warmup: int = 1, log=print) -> dict[str, Outcome]:
    """Builds each variant in its own worker and times them in interleaved rounds.

    `resident` (default: all) names the variants whose workers stay alive for
    the whole run. Each other variant is built after them, timed in rounds
    interleaved with the resident ones, and ended before the next is built:
    a worker that holds gigabytes (a traced or compiled step of thousands of
    variables) then never shares the machine with another one. A worker is
    also killed when the machine's available memory falls below
    `memory_floor_gib` (other processes share it).
    """
    resident = list(variants) if resident is None else [name for name in variants if name in resident]
    outcomes = {name: Outcome() for name in variants}
    limits = (rss_limit_gib, memory_floor_gib)
    alive = {}

    def build(name):
        start = time.perf_counter()
        load = os.getloadavg()[0]
        worker = _Worker(variants[name].argv)
        line = worker.reply(outcomes[name], variants[name].build_limit, *limits, "the first call")
        outcomes[name].built_in = time.perf_counter() - start
        if line is None:
            log(f"  {name}: {outcomes[name].failure}")
            return None
        outcomes[name].first = float(line.split()[1])
        log(f"  {name}: first call {outcomes[name].first:.1f} s (ready after {outcomes[name].built_in:.0f} s, "
            f"load {load:.1f}, RSS {outcomes[name].peak_rss:.1f} GiB)")
        return worker

    def rounds_of(workers):
        for index in range(warmup + rounds):
            for name, worker in list(workers.items()):
                worker.send("measure")
                line = worker.reply(outcomes[name], round_limit, *limits, f"round {index}")
                if line is None:
                    del workers[name]
                    alive.pop(name, None)
                    log(f"  {name}: {outcomes[name].failure}")
                elif index >= warmup:
                    outcomes[name].times.append(float(line.split()[1]))

    def end(name, worker):
        worker.send("note")
        line = worker.reply(outcomes[name], round_limit, *limits, "the note")
        if line is not None:
            outcomes[name].note = line[len("note"):].strip()
            worker.send("quit")
            worker.process.wait(timeout=60)

    try:
        for name in resident:
            worker = build(name)
            if worker is not None:
                alive[name] = worker
        visitors = [name for name in variants if name not in resident]
        if not visitors:
            rounds_of(dict(alive))
        for name in visitors:
            worker = build(name)
            if worker is None:
                continue
            try:
                rounds_of({name: worker, **alive})
                if worker.process.poll() is None:
                    end(name, worker)
            finally:
                worker.kill()
        for name, worker in alive.items():
            end(name, worker)
    finally:
        for worker in alive.values():
            worker.kill()
    return outcomes


def table(title: str, outcomes: dict[str, Outcome], baseline: str | None, *, as_share: bool = False) -> None:
    """Median ms (min-max over rounds), ratio to `baseline`, first call, peak RSS; failures say why.

    `as_share`: the ratio is baseline / row as a percentage (the share of a
    reference speed, as P3's "vs copy"); otherwise row / baseline ("0.58x").
    """
    base = None
    if baseline is not None and outcomes.get(baseline) and outcomes[baseline].times:
        base = statistics.median(outcomes[baseline].times)
    print(f"\n{title}")
    print(f"{'variant':46s} {'median ms':>10s} {'min-max':>15s} {'ratio':>7s} {'first call':>11s} {'peak RSS':>9s}")
    for name, outcome in outcomes.items():
        first = "" if outcome.first is None else f"{outcome.first:.1f} s"
        if outcome.times:
            median = statistics.median(outcome.times)
            spread = f"{min(outcome.times):.1f}-{max(outcome.times):.1f}"
            ratio = "" if base is None else (f"{base / median:.0%}" if as_share else f"{median / base:.2f}x")
            print(f"{name:46s} {median:10.1f} {spread:>15s} {ratio:>7s} {first:>11s} {outcome.peak_rss:7.1f} G")
        else:
            print(f"{name:46s} {'-':>10s} {'':>15s} {'':>7s} {first:>11s} {outcome.peak_rss:7.1f} G")
        if outcome.failure:
            print(f"{'':46s} {outcome.failure}")
        if outcome.note:
            print(f"{'':46s} {outcome.note}")
