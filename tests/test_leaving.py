"""kmp.distribute.leaving: the tasks of a multi-worker job leave together at exit, the coordination leader last.

TensorFlow runs the job's coordination service in the leader (worker 0 here);
a worker still exiting when the leader is gone can abort (exit code -6). The
wait is tested against real sockets and, end to end, on two real workers.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import textwrap
import threading
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
        # Shut down first, so that it stops listening at once while the thread is blocked in accept.
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def test_the_wait_ends_when_the_address_stops_listening(monkeypatch):
    """Each look at the address is recorded; the server closes after the first: the next look ends the wait."""
    server, looks, listening = _Server(), [], leaving._listening

    def look(address):
        looks.append(listening(address))
        if len(looks) == 1:
            server.close()
        return looks[-1]

    monkeypatch.setattr(leaving, "_listening", look)
    assert leaving.wait_for_exit([server.address], seconds=60) == []  # the deadline only guards a hang
    assert looks == [True, False]


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
    monkeypatch.setattr(leaving, "wait_for_exit", lambda *_: pytest.fail("the leader waited for the others"))
    try:
        with caplog.at_level(logging.WARNING, logger="kmp.distribute.leaving"):
            leaving._leave()
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
    """Worker 1 takes 4 s longer to finish; worker 0, the leader, ends after it, and both succeed.

    The leader's last exit handler, registered before kmp is imported so that it runs after kmp's own,
    records what it sees of worker 1: its script finished, and its server no longer accepts connections.
    """
    finished, seen = tmp_path / "worker1-finished", tmp_path / "leader-saw.json"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, json, os, socket, time

        config = json.loads(os.environ["TF_CONFIG"])
        index, other = config["task"]["index"], config["cluster"]["worker"][1]

        def accepting(address):
            host, port = address.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                return True
            except OSError:
                return False

        def saw():
            with open({str(seen)!r}, "w") as f:
                json.dump({{"finished": os.path.exists({str(finished)!r}), "accepting": accepting(other)}}, f)

        if index == 0:
            atexit.register(saw)  # before kmp's: runs after it
        import tensorflow as tf
        import kmp

        strategy = kmp.distribute.resolve_strategy()
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        assert float(total) == 2.0, total
        if index == 1:
            time.sleep(4)  # a worker whose work (or exit) takes longer
            open({str(finished)!r}, "w").close()
    """))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with LocalJob([sys.executable, script], 2, env=env, cwd=tmp_path, log_dir=tmp_path, threads=False) as job:
        codes = job.wait(timeout=240)  # a hang guard; a failed worker stops the other
    outputs = [(tmp_path / f"worker{index}.log").read_text()[-3000:] for index in range(2)]
    assert codes == [0, 0], outputs
    # Without the wait the leader exits while worker 1 still works: not finished, its server accepting.
    assert json.loads(seen.read_text()) == {"finished": True, "accepting": False}, outputs
    assert not any("leaving without the other workers" in output for output in outputs), outputs
