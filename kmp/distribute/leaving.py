"""Under MultiWorkerMirroredStrategy, the workers leave together, the coordination leader last.

TensorFlow runs a multi-worker job's coordination service inside one task,
the leader (chief 0, else worker 0), and every other task sends it
heartbeats until its process ends. When the leader exits first, a task
still shutting down finds the service gone: its collective executor aborts,
and a worker whose work was done can die of SIGABRT (exit code -6) in its
own exit, failing the job.

So in a process that built or prepared for a multi-worker strategy, at
exit, after kmp's other exit work:

    every task:  waits at the service's barrier for the others (up to LEAVE_SECONDS);
                 when the service knows a task failed the barrier fails at once, and it exits
    the leader, once the barrier is passed: waits until no other task's server
                 accepts connections (their processes ended), up to LEAVE_SECONDS

A process ending on an uncaught exception skips both: the others then fail
(within TensorFlow's heartbeat timeout, about 10 s) instead of waiting on
it. A wait longer than SAY_SECONDS is said in one line.
"""

from __future__ import annotations

import atexit
import logging
import socket
import sys
import threading
import time

import tensorflow as tf

from kmp import seams

logger = logging.getLogger(__name__)

# Longer than kmp's own exit work (input iterators, up to two minutes): a task still running then is stuck.
LEAVE_SECONDS = 150.0
SAY_SECONDS = 10.0  # a task's own exit takes a few seconds; longer is worth a line
POLL_SECONDS = 0.1
BARRIER = "kmp-leave"
_COORDINATED = ("chief", "worker")  # TensorFlow's coordinated jobs; an evaluator is not one

# Set once this process is known to be a task of a multi-worker job: whether it leads, the others' addresses.
_job: dict | None = None


def leave_last(strategy: tf.distribute.Strategy) -> None:
    """If `strategy` is a multi-worker job's, this process leaves it together with the others at exit."""
    global _job
    job = _job_of(strategy)
    if job is not None:
        _job = job


def _job_of(strategy) -> dict | None:
    """{"leader": this task leads, "peers": the other coordinated tasks' addresses}, or None."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return None
    jobs = resolver.cluster_spec().as_dict()
    leader = ("chief", 0) if "chief" in jobs else ("worker", 0)  # multi_worker_util.coordination_leader
    me = (resolver.task_type, resolver.task_id)
    peers = []
    for name in _COORDINATED:
        addresses = jobs.get(name, [])
        indexed = addresses.items() if isinstance(addresses, dict) else enumerate(addresses)
        peers += [address for index, address in indexed if (name, index) != me]
    if me[0] not in _COORDINATED or not peers:  # an evaluator, or a job of one task
        return None
    return {"leader": me == leader, "peers": peers}


def _leave() -> None:
    job = _job
    if job is None or getattr(sys, "last_value", None) is not None:  # set by an uncaught exception
        return
    said = threading.Timer(SAY_SECONDS, logger.warning, [
        "kmp: waiting (at most %.0f s) for the other workers to finish: the job's tasks leave together, so "
        "that none loses the coordination service while it exits.", LEAVE_SECONDS])
    said.start()
    try:
        seams.get("eager_context")().wait_at_barrier(BARRIER, int(LEAVE_SECONDS * 1000))
    except Exception as error:  # a task failed or the wait timed out: nothing left to wait for
        logger.warning("kmp: leaving without the other workers: %s", (str(error).splitlines() or [repr(error)])[0])
        return
    finally:
        said.cancel()
    if job["leader"]:
        left = wait_for_exit(job["peers"], LEAVE_SECONDS)
        if left:
            logger.warning("kmp: %s still ran %.0f s after this task, the coordination leader, finished; it exits "
                           "now, and they lose the coordination service.", ", ".join(left), LEAVE_SECONDS)


def wait_for_exit(addresses: list[str], seconds: float) -> list[str]:
    """Wait until no server listens at any of `addresses` ("host:port"), up to `seconds`; returns those left."""
    end = time.monotonic() + seconds
    left = list(addresses)
    while left:
        left = [address for address in left if _listening(address)]
        if not left or time.monotonic() >= end:
            break
        time.sleep(POLL_SECONDS)
    return left


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):  # refused, unreachable, unresolvable: nothing there to wait for
        return False


# Registered at import, before kmp.engine.iterators registers its own exit work, so this runs after it.
atexit.register(_leave)
