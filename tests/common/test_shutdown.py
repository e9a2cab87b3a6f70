"""serve_forever's drain: a clean drain closes and exits 0; an unfinished one exits 1 without closing; a stuck
one is reported with every thread's stack and exits 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from strop.common.grpc_server import build_server, serve_forever

    mode = sys.argv[1]
    closed = sys.argv[2]
    running = build_server([])

    def drain():
        if mode == "stuck":
            threading.Event().wait()  # the drain itself hangs
        return mode != "unfinished"  # a job that did not stop within the grace

    def close():
        open(closed, "w").write("closed")

    print(running.port, flush=True)
    serve_forever(running, grace=0.5, on_drain=drain, on_close=close, slack=2.0)
    """
)


def run_and_terminate(mode: str, closed_path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode, str(closed_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert int(proc.stdout.readline()) > 0, "the server reports its port once serving"
    time.sleep(1.0)  # let serve_forever install its handlers after the port is printed
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the service neither drained nor was stopped by its watchdog")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_clean_drain_closes_and_exits_zero(tmp_path):
    done = run_and_terminate("clean", tmp_path / "closed")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "closed").read_text() == "closed"


def test_stuck_drain_dumps_every_thread_and_exits_one(tmp_path):
    t0 = time.monotonic()
    done = run_and_terminate("stuck", tmp_path / "closed")
    assert done.returncode == 1
    assert 3.0 <= time.monotonic() - t0 < 20, "the watchdog fires after 2 x grace + slack"
    assert "Timeout" in done.stderr and "in drain" in done.stderr, "the stuck frame is in the stacks"
    assert not (tmp_path / "closed").exists()


def test_drain_that_leaves_work_running_exits_one_without_closing(tmp_path):
    done = run_and_terminate("unfinished", tmp_path / "closed")
    assert done.returncode == 1
    assert "still running" in done.stderr
    assert not (tmp_path / "closed").exists(), "the store is not closed under a job that is still running"
