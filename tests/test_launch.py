"""kmp.cli.launch and `kmp launch`: local workers with their TF_CONFIG, stopped together; DeepSpeed hostfiles."""

import io
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kmp.cli import launch
from kmp.errors import KmpError

ROOT = Path(__file__).resolve().parent.parent


def _script(tmp_path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; LocalJob reaps, so existence means alive.
    return True


def _environ():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_free_ports_are_distinct_and_bindable():
    ports = launch.free_ports(8)
    assert len(set(ports)) == 8
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_each_worker_gets_its_own_tf_config_and_its_output_is_prefixed(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        config = json.loads(os.environ["TF_CONFIG"])
        print(json.dumps({"config": config, "threads": os.environ["TF_NUM_INTRAOP_THREADS"], "args": sys.argv[1:]}))
    """)
    out = io.StringIO()
    with launch.LocalJob([sys.executable, script, "--x", "1"], 3, stream=out) as job:
        assert job.wait(timeout=60) == [0, 0, 0]
    assert job.exit_status() == 0
    seen = {}
    for line in out.getvalue().splitlines():
        prefix, _, rest = line.partition("] ")
        seen[int(prefix.removeprefix("[worker "))] = json.loads(rest)
    assert sorted(seen) == [0, 1, 2]
    for index, got in seen.items():
        assert got["config"] == {"cluster": {"worker": job.addresses}, "task": {"type": "worker", "index": index}}
        assert got["args"] == ["--x", "1"]
        assert got["threads"] == str(max(1, (os.cpu_count() or 1) // 3))
    assert len(set(job.addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in job.addresses)


def test_one_failing_worker_stops_the_others_and_its_status_is_the_jobs(tmp_path):
    started = tmp_path / "child-started"
    script = _script(tmp_path, f"""
        import json, os, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if index == 1:
            while not os.path.exists({str(started)!r}):  # fails once worker 0 has its child
                time.sleep(0.05)
            sys.exit(7)
        # A child in the worker's process group: it must be stopped too.
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", child.pid, flush=True)
        open({str(started)!r}, "w").close()
        time.sleep(600)
    """)
    out = io.StringIO()
    job = launch.LocalJob([sys.executable, script], 2, stream=out)
    with job:
        codes = job.wait(timeout=120)  # a hang guard: the failure stops the job long before
    assert codes[1] == 7 and codes[0] == -signal.SIGTERM  # worker 0 was stopped, and did not need SIGKILL
    assert job.failed_first == 1 and job.exit_status() == 7 and not job.timed_out
    child = int(next(line for line in out.getvalue().splitlines() if " child " in line).split()[-1])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    assert not any(_alive(p.pid) for p in job.processes)


def test_the_timeout_stops_everyone_with_status_124(tmp_path):
    script = _script(tmp_path, "import time; time.sleep(600)\n")
    job = launch.LocalJob([sys.executable, script], 2, stream=io.StringIO())
    with job:
        codes = job.wait(timeout=1)
    assert all(c is not None and c < 0 for c in codes)
    assert job.timed_out and job.exit_status() == 124


def test_log_files_per_worker(tmp_path):
    script = _script(tmp_path, "import os; print('hello from', os.environ['TF_CONFIG'][-3:])\n")
    with launch.LocalJob(lambda i: [sys.executable, script, str(i)], 2, log_dir=tmp_path) as job:
        assert job.wait(timeout=60) == [0, 0]
    assert (tmp_path / "worker0.log").read_text().startswith("hello from")
    assert (tmp_path / "worker1.log").read_text().startswith("hello from")


def test_hostfile_in_deepspeeds_format():
    # The example of DeepSpeed's docs (docs/_tutorials/getting-started.md): "worker-1 slots=4".
    text = "# the cluster\nworker-1 slots=4\n\n   worker-2 slots=2  \n"
    hosts = launch.parse_hostfile(text)
    assert hosts == [("worker-1", 4), ("worker-2", 2)]
    commands = launch.host_commands(hosts, ["python", "train.py", "--a", "b c"], 29500)
    assert [h for h, _ in commands] == ["worker-1"] * 4 + ["worker-2"] * 2
    workers = [f"worker-1:{29500 + s}" for s in range(4)] + ["worker-2:29500", "worker-2:29501"]
    for index, (_, line) in enumerate(commands):
        assert line.endswith(" python train.py --a 'b c'")
        config = json.loads(line.split("'")[1])
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


@pytest.mark.parametrize("text,match", [
    ("worker-1 slots=4\nworker-1 slots=2\n", r"line 2: host 'worker-1' is listed twice"),
    ("worker-1 slots=4\nworker-2\n", r"line 2: expected 'hostname slots=N' .*Received: 'worker-2'"),
    ("worker-1 slots=0\n", r"line 1: expected slots >= 1"),
    ("# nothing\n\n", r"expected at least one 'hostname slots=N' line"),
])
def test_a_bad_hostfile_names_the_line(text, match):
    with pytest.raises(KmpError, match=match):
        launch.parse_hostfile(text)


def test_the_cli_end_to_end(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print("worker says", index)
        sys.exit(3 if index == 1 and "--fail" in sys.argv else 0)
    """)
    run = lambda *args: subprocess.run([sys.executable, "-m", "kmp.cli.main", "launch", *args], env=_environ(),  # noqa
                                       capture_output=True, text=True, timeout=120)
    ok = run("--workers", "2", str(script))
    assert ok.returncode == 0, ok.stderr
    assert "[worker 0] worker says 0" in ok.stdout and "[worker 1] worker says 1" in ok.stdout
    failed = run("--workers", "2", str(script), "--fail")
    assert failed.returncode == 3
    assert "worker 1 failed (exit status 3)" in failed.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    printed = run("--hostfile", str(hostfile), "--master-port", "1234", "train.py")
    assert printed.returncode == 0
    assert printed.stdout.count("TF_CONFIG=") == 2 and '"b:1234"' in printed.stdout
    hostfile.write_text("a slots=x\n")
    bad = run("--hostfile", str(hostfile), "train.py")
    assert bad.returncode != 0 and "line 1: expected 'hostname slots=N'" in bad.stderr and "Traceback" not in bad.stderr
    none = run("--workers", "0", str(script))
    assert none.returncode == 2 and "expected at least 1 worker. Received: workers=0" in none.stderr
    assert "worker says" not in none.stdout and "Traceback" not in none.stderr


@pytest.mark.slow
def test_the_multiworker_recipe_runs_under_kmp_launch():
    """Two real TensorFlow workers (MultiWorkerMirroredStrategy) of recipes/multiworker.py."""
    done = subprocess.run([sys.executable, "-m", "kmp.cli.main", "launch", "--workers", "2", "--timeout", "300",
                           "recipes/multiworker.py", "--epochs", "1"], env=_environ(), cwd=ROOT,
                          capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finals = [line.split("] ", 1)[1] for line in done.stdout.splitlines() if "test accuracy" in line]
    assert len(finals) == 2
    # Both workers hold the same weights: the same numbers, but for the time.
    numbers = {line.split(": ", 1)[1].rsplit("|", 1)[0] for line in finals}
    assert len(numbers) == 1, finals
    assert "CollectiveAllReduceStrategy, 2 replicas" in done.stdout


@pytest.mark.slow
def test_the_causal_lm_recipe_runs_under_kmp_launch(tmp_path):
    """recipes/causal_lm.py on two real workers, each reading tensorflow-datasets' mock imdb_reviews."""
    worker = _script(tmp_path, f"""
        import runpy, sys
        import tensorflow_datasets as tfds

        sys.argv[0] = {str(ROOT / "recipes" / "causal_lm.py")!r}
        with tfds.testing.mock_data(num_examples=64, policy=tfds.testing.MockPolicy.USE_CODE):
            runpy.run_path(sys.argv[0], run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-m", "kmp.cli.main", "launch", "--workers", "2", "--timeout", "300",
                           str(worker), "--steps", "2", "--batch-size", "4", "--length", "32"],
                          env=_environ(), cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for task in (0, 1):
        assert f"[worker {task}] CollectiveAllReduceStrategy, 2 replicas | tiny GPT-2" in out, out
        assert (f"[worker {task}] transformers__tests__deepspeed__ds_config_zero2.json: fp16, batch 8 = "
                "micro-batch 4 x 1 x 2 replicas") in out, out
    finals = [line.split("] ", 1)[1] for line in out.splitlines() if "test loss" in line]
    assert len(finals) == 2
    numbers = {line.rsplit("|", 1)[0] for line in finals}  # the same weights on both workers: all but the time
    assert len(numbers) == 1, finals
    loss = float(finals[0].split("test loss ", 1)[1].split(" ", 1)[0])
    assert math.isfinite(loss) and "optimizer steps 2" in finals[0]


@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_refused_before_any_worker_starts(tmp_path, capsys, timeout):
    from kmp.cli import main as cli

    script = _script(tmp_path, "print('worker says hello')")
    assert cli.main(["launch", "--workers", "1", "--timeout", timeout, str(script)]) == 2
    out, err = capsys.readouterr()
    assert err == (f"kmp: kmp launch: expected --timeout > 0 seconds (or none: no limit). Received: "
                   f"timeout={float(timeout)}.\n")
    assert out == ""  # no worker announced, none started
