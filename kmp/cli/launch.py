"""`kmp launch`: start a MultiWorkerMirroredStrategy job's workers, each with its TF_CONFIG.

    kmp launch --workers 2 train.py --epochs 3      # two local workers on 127.0.0.1
    kmp launch --hostfile hosts train.py            # each host's commands, DeepSpeed's hostfile

Locally, one process per worker (`sys.executable script args`), each with

    TF_CONFIG = {"cluster": {"worker": ["127.0.0.1:p0", ..., "127.0.0.1:pN-1"]},
                 "task": {"type": "worker", "index": i}}

on ports free when chosen, and TF_NUM_INTRAOP_THREADS = cores // N unless
set (N workers share the machine's cores; TensorFlow would give each all of
them; it reads the variable in core/common_runtime/process_util.cc). Each line a worker prints is relayed as `[worker i] line`. When a
worker exits with an error, the others are stopped (SIGTERM to its process
group, SIGKILL after a grace period): its peers would otherwise wait in
their collectives until they time out. Ctrl-C and a `--timeout` stop them
the same way; no process is left behind. The exit status is the first
failing worker's (128 + N for a signal), else 0.

With `--hostfile` (DeepSpeed's format, deepspeed/launcher/runner.py's
`_parse_hostfile`: `hostname slots=N` lines, `#` comments and blank lines
skipped, a host listed twice is an error), each slot is one worker, on
`host:master_port + slot`; kmp prints each worker's command with its
TF_CONFIG, to be run on that host (kmp does not ssh).

No TensorFlow import: `kmp launch` starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kmp.errors import KmpError

GRACE_S = 5.0  # between SIGTERM and SIGKILL
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's launcher's default (deepspeed/launcher/constants.py)
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's pattern


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (all sockets stay open until every port is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(workers: Sequence[str], index: int) -> str:
    """The TF_CONFIG of worker `index` of the cluster `workers` ("host:port" each)."""
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


class LocalJob:
    """Worker processes on 127.0.0.1, each in its own process group, stopped together.

        with LocalJob([sys.executable, "train.py"], workers=2) as job:
            codes = job.wait(timeout=600)   # stops all at the first failure

    `command` is one command for every worker, or a function of the worker's
    index. Output: relayed to `stream` with a `[worker i] ` prefix, or, with
    `log_dir`, written to `log_dir/worker<i>.log`.
    """

    def __init__(self, command: Sequence[str] | Callable[[int], Sequence[str]], workers: int, *,
                 env: dict | None = None, cwd: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None,
                 stream=None, threads: bool = True):
        if workers < 1:
            raise KmpError(f"kmp launch: expected at least 1 worker. Received: workers={workers}.")
        self.command = command if callable(command) else (lambda _: command)
        self.count, self.env, self.cwd, self.threads = workers, env, cwd, threads
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.stream = stream
        self.addresses = [f"127.0.0.1:{port}" for port in free_ports(workers)]
        self.processes: list[subprocess.Popen] = []
        self._relays: list[threading.Thread] = []
        self.failed_first: int | None = None  # the index of the first worker seen failing
        self.timed_out = False

    def start(self) -> LocalJob:
        for index in range(self.count):
            self.processes.append(self._start(index))
        return self

    def _start(self, index: int) -> subprocess.Popen:
        env = dict(os.environ if self.env is None else self.env)
        env["TF_CONFIG"] = tf_config(self.addresses, index)
        if self.threads:
            env.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, (os.cpu_count() or 1) // self.count)))
        command = [str(c) for c in self.command(index)]
        if self.log_dir is not None:
            with open(self.log_dir / f"worker{index}.log", "w") as log:
                return subprocess.Popen(command, env=env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        process = subprocess.Popen(command, env=env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", start_new_session=True)
        relay = threading.Thread(target=self._relay, args=(process, index), daemon=True)
        relay.start()
        self._relays.append(relay)
        return process

    def _relay(self, process: subprocess.Popen, index: int) -> None:
        stream = self.stream or sys.stdout
        for line in process.stdout:
            stream.write(f"[worker {index}] {line}")
            stream.flush()

    def wait(self, timeout: float | None = None) -> list[int | None]:
        """Exit codes once all exited; at the first failure or the timeout, the others are stopped first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in self.processes):
                failing = [i for i, p in enumerate(self.processes) if p.poll() not in (None, 0)]
                if failing:
                    self.failed_first = failing[0]
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self.timed_out = True
                    break
                time.sleep(0.1)
            # All exited between two looks: the first by index that failed.
            if self.failed_first is None and not self.timed_out:
                self.failed_first = next((i for i, p in enumerate(self.processes) if p.poll() not in (None, 0)), None)
        finally:  # also on Ctrl-C
            self.stop()
        return [p.returncode for p in self.processes]

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM every running worker's process group, SIGKILL what is left after `grace` s; reap all."""
        running = [p for p in self.processes if p.poll() is None]
        _signal_groups(running, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < end:
            time.sleep(0.05)
        _signal_groups(self.processes, signal.SIGKILL)  # the groups: a worker's own children too
        for p in self.processes:
            p.wait()
        for relay in self._relays:
            relay.join(timeout=5)

    def exit_status(self) -> int:
        """The first failing worker's exit status (128 + N for signal N); 124 on the timeout; else 0."""
        if self.failed_first is None:
            return 124 if self.timed_out else 0
        code = self.processes[self.failed_first].returncode
        return 128 - code if code < 0 else code

    def __enter__(self) -> LocalJob:
        return self.start() if not self.processes else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_groups(processes, sig) -> None:
    for p in processes:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone


def run_local(command: Sequence[str], workers: int, timeout: float | None = None) -> int:
    """`kmp launch --workers N`: start, relay, wait, stop; the exit status."""
    if timeout is not None and not timeout > 0:  # nan too
        raise KmpError(f"kmp launch: expected --timeout > 0 seconds (or none: no limit). Received: timeout={timeout}.")
    job = LocalJob(command, workers)
    print(f"kmp launch: {workers} workers on {', '.join(job.addresses)}", flush=True)
    try:
        job.start()
        codes = job.wait(timeout)
    except KeyboardInterrupt:
        job.stop()
        print("kmp launch: interrupted; every worker stopped", file=sys.stderr, flush=True)
        return 130
    status = job.exit_status()
    if job.failed_first is not None:
        print(f"kmp launch: worker {job.failed_first} failed (exit status {status}); the others were stopped. "
              f"Exit codes: {codes}", file=sys.stderr, flush=True)
    elif job.timed_out:
        print(f"kmp launch: timed out after {timeout} s; every worker stopped", file=sys.stderr, flush=True)
    return status


def parse_hostfile(text: str, name: str = "hostfile") -> list[tuple[str, int]]:
    """[(host, slots)] in file order, from DeepSpeed's hostfile format; KmpError with the line on a bad one."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if not match:
            raise KmpError(f"{name}, line {number}: expected 'hostname slots=N' (DeepSpeed's hostfile format). "
                           f"Received: {line!r}.")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise KmpError(f"{name}, line {number}: host {host!r} is listed twice; DeepSpeed refuses that too. "
                           "Give it one line with all its slots.")
        if slots < 1:
            raise KmpError(f"{name}, line {number}: expected slots >= 1. Received: slots={slots} for {host!r}.")
        hosts[host] = slots
    if not hosts:
        raise KmpError(f"{name}: expected at least one 'hostname slots=N' line. Received: none.")
    return list(hosts.items())


def host_commands(hosts: list[tuple[str, int]], command: Sequence[str], master_port: int) -> list[tuple[str, str]]:
    """[(host, shell command)], one per slot: `TF_CONFIG=... command`, slot s of a host on master_port + s."""
    workers = [f"{host}:{master_port + slot}" for host, slots in hosts for slot in range(slots)]
    out = []
    for index, address in enumerate(workers):
        host = address.rsplit(":", 1)[0]
        out.append((host, f"TF_CONFIG={shlex.quote(tf_config(workers, index))} {shlex.join(command)}"))
    return out
