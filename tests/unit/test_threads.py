"""The compute thread: engine work from any thread runs on one thread, and no other thread starts an OpenMP pool."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from agent_mtp.engine.threads import ComputeThread, single_threaded


def test_run_returns_raises_and_keeps_grad_mode() -> None:
    worker = ComputeThread(1)
    try:
        assert worker.run(lambda a, b=0: a + b, 2, b=3) == 5
        assert worker.run(threading.get_ident) == worker.ident != threading.get_ident()
        with pytest.raises(KeyError, match="boom"):
            worker.run(lambda: {}["boom"])
        with torch.no_grad():
            assert worker.run(torch.is_grad_enabled) is False
        assert worker.run(torch.is_grad_enabled) is True
        # reentrant: work that submits work runs it inline instead of waiting for itself
        assert worker.run(lambda: worker.run(threading.get_ident)) == worker.ident
    finally:
        worker.stop()


def test_single_threaded_restores_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_mtp.engine import threads

    worker = ComputeThread(1)  # engine work on a compute thread (an earlier test may have chosen the caller's)
    monkeypatch.setattr(threads, "_compute", worker)
    seen: dict[str, int] = {}

    def body() -> None:
        torch.set_num_threads(2)
        with single_threaded():
            seen["inside"] = torch.get_num_threads()
        seen["after"] = torch.get_num_threads()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    worker.stop()
    assert seen == {"inside": 1, "after": 2}


POOLS = textwrap.dedent(
    """
    import json, os, threading, torch
    torch.set_num_threads(2)
    from agent_mtp.engine.threads import compute, single_threaded

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    big = torch.rand(4_000_000)
    def work():
        return float(big.exp().sum())  # parallel regions on a 2-thread pool

    compute().run(work)  # the compute thread and its pool exist
    base = os_threads()

    def in_threads(body, n=3):
        ready, go = threading.Barrier(n + 1), threading.Event()
        def run():
            body()
            ready.wait()
            go.wait()
        threads = [threading.Thread(target=run) for _ in range(n)]
        for t in threads:
            t.start()
        ready.wait()
        count = os_threads()
        go.set()
        for t in threads:
            t.join()
        return count - base - n  # OS threads beyond the n Python threads themselves

    def guarded():
        compute().run(work)
        with single_threaded():
            work()

    print(json.dumps({"guarded": in_threads(guarded), "unguarded": in_threads(work)}))
    """
)


def test_engine_work_from_many_threads_starts_no_other_openmp_pool() -> None:
    """In a fresh process with 2 torch threads: threads that send work to the compute thread and run their own ops
    single-threaded add no OS thread; the control (ops on 2 threads outside the guard) adds one OpenMP worker per
    thread, the case that made every forward pass ~1.5x slower (agent_mtp/engine/threads.py)."""
    out = subprocess.run([sys.executable, "-c", POOLS], capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    if counts["unguarded"] == 0:
        pytest.skip("this torch build starts no per-thread OpenMP pools (nothing to guard against)")
    assert counts["guarded"] == 0, counts
    assert counts["unguarded"] >= 3, counts
