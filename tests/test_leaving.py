"""kmp.distribute.leaving: the tasks of a multi-worker job leave together at exit, the coordination leader last.

TensorFlow runs the job's coordination service in the leader (worker 0 here);
a worker still exiting when the leader is gone can abort (exit code -6). The
wait is tested against real sockets and, end to end, on two real workers.
"""

import logging
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import tensorflow as tf

from kmp.cli.launch import LocalJob, free_ports
from kmp.distribute import leaving

ROOT = Path(__file__).resolve().parent.parent


class _Server:
    """A listening address that accepts, as a worker's gRPC server does, until closed."""

    def __init__(self):
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            connection.close()

    def close(self):
        self._socket.close()


def test_the_wait_ends_when_the_address_stops_listening():
    server = _Server()
    threading.Timer(0.5, server.close).start()
    start = time.monotonic()
    assert leaving.wait_for_exit([server.address], seconds=30) == []
    assert 0.4 < time.monotonic() - start < 10


def test_an_address_still_listening_at_the_deadline_is_returned():
    server, (gone,) = _Server(), free_ports(1)
    try:
        left = leaving.wait_for_exit([server.address, f"127.0.0.1:{gone}", "not-an-address"], seconds=0.3)
    finally:
        server.close()
    assert left == [server.address]


def test_without_a_barrier_to_meet_at_the_leader_leaves_at_once(monkeypatch, caplog):
    """No coordination service (or one that knows a task failed): the barrier fails and no one is waited for."""
    server = _Server()
    monkeypatch.setattr(leaving, "_job", {"leader": True, "peers": [server.address]})
    monkeypatch.delattr(sys, "last_value", raising=False)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kmp.distribute.leaving"):
            leaving._leave()
        assert time.monotonic() - start < 5
        assert "kmp: leaving without the other workers: " in caplog.text
    finally:
        server.close()


def test_an_uncaught_exception_leaves_at_once(monkeypatch, caplog):
    monkeypatch.setattr(leaving, "_job", {"leader": True, "peers": ["127.0.0.1:1"]})
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    with caplog.at_level(logging.INFO, logger="kmp.distribute.leaving"):
        leaving._leave()
    assert caplog.text == ""  # not even the barrier: the others fail soon instead of waiting on this task


def test_a_process_outside_a_multi_worker_job_waits_for_no_one(two_replicas, monkeypatch):
    monkeypatch.setattr(leaving, "_job", None)
    leaving.leave_last(two_replicas)
    leaving.leave_last(tf.distribute.get_strategy())
    assert leaving._job is None


@pytest.mark.slow
def test_the_leader_of_two_real_workers_exits_after_the_other(tmp_path):
    """Worker 1 takes 4 s longer to finish; worker 0, the leader, ends after it, and both succeed."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, os, time
        import tensorflow as tf
        import kmp

        strategy = kmp.distribute.resolve_strategy()
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        assert float(total) == 2.0, total
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            time.sleep(4)  # a worker whose work (or exit) takes longer
    """))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ended = [None, None]
    with LocalJob([sys.executable, script], 2, env=env, cwd=tmp_path, log_dir=tmp_path, threads=False) as job:
        deadline = time.monotonic() + 240
        while None in ended and time.monotonic() < deadline:
            if any(process.poll() not in (None, 0) for process in job.processes):
                break  # a failed worker: its peer would wait in vain
            for index, process in enumerate(job.processes):
                if ended[index] is None and process.poll() is not None:
                    ended[index] = time.monotonic()
            time.sleep(0.05)
        codes = job.wait(timeout=0)  # stops whoever is left
    outputs = [(tmp_path / f"worker{index}.log").read_text()[-3000:] for index in range(2)]
    assert codes == [0, 0], outputs
    # Without the wait worker 0 ends about 4 s first. A second of slack: a worker's server closes
    # its port in its exit, a moment before the process is reaped.
    assert ended[0] > ended[1] - 1.0, (ended, outputs)
    assert not any("leaving without the other workers" in output for output in outputs), outputs
