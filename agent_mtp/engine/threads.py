"""One thread per process runs the engine's multi-threaded torch work; every other thread's torch ops run on one.

Why: torch's CPU kernels run on OpenMP (GNU libgomp). Each thread that starts a parallel region with more than one
thread gets a pool of worker threads of its own, and once a process holds more libgomp threads than it has CPUs,
libgomp stops spinning between parallel regions: each of a forward pass's several hundred regions then waits for a
futex wake-up. Measured on the 2-core machine (torch 2.13, 2 threads, default model, fast runtime, one-token pass
on a 300-token context, `scripts/thread_pools.py`): on the main thread 40 ms; the same pass on a second thread after
the main thread had run parallel work 60-80 ms; on a second thread when no other thread had, 39 ms. A server (an
event loop, a batch scheduler, one decode thread per request) and async agents (``asyncio.to_thread``) paid the
slow case on every pass.

So the engine's forward passes, the preparation of the fast model, prefix-cache copies, model loading and the
cost-curve measurement run on one long-lived thread (:func:`compute`), and the decode loop's small torch ops
(sampling, grammar masks) run single-threaded on whichever thread decodes (:func:`single_threaded`)::

    logits = compute().run(model.forward, tokens, cache, keep)    # from any thread
    with single_threaded():                                       # sampling on the caller's thread
        token = int(logits[0].argmax())

The compute thread uses the torch thread count of the thread that first needed it (``torch.set_num_threads`` before
loading an engine, as before) and :func:`set_compute_threads` changes it. A process that does its own
multi-threaded torch work beside the engine (training, which evaluates the adapter as it trains) runs the engine's
work on the calling thread instead: :func:`use_caller_thread`, or ``AGENT_MTP_COMPUTE_THREAD=0``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")
ENV_COMPUTE_THREAD = "AGENT_MTP_COMPUTE_THREAD"
"""``0``/``false``/``off``: run engine work on the calling thread (see :func:`use_caller_thread`)."""


@dataclass
class _Work:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: bool
    """The caller's grad mode (thread-local in torch): the work runs under it."""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class ComputeThread:
    """A daemon thread that runs submitted callables one at a time, in order, with ``threads`` torch threads."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads!r} is invalid; use an int >= 1.")
        self.threads = threads
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="agent-mtp-compute", daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def on_thread(self) -> bool:
        """True when called from the compute thread itself."""
        return threading.get_ident() == self._thread.ident

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread (directly when already on it); its exception re-raised."""
        if self.on_thread():
            return fn(*args, **kwargs)
        work = _Work(fn, args, kwargs, torch.is_grad_enabled())
        self._queue.put(work)
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work.result  # type: ignore[no-any-return]

    def set_threads(self, threads: int) -> None:
        """Change the compute thread's torch thread count."""
        if threads < 1:
            raise ValueError(f"threads={threads!r} is invalid; use an int >= 1.")
        self.run(torch.set_num_threads, threads)
        self.threads = threads

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                with torch.set_grad_enabled(work.grad):
                    work.result = work.fn(*work.args, **work.kwargs)
            except BaseException as e:  # the caller re-raises it
                work.error = e
            finally:
                work.done.set()


class _CallerThread:
    """:func:`compute` when engine work runs on the calling thread (:func:`use_caller_thread`)."""

    threads = 0

    def on_thread(self) -> bool:
        return True

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)


_lock = threading.Lock()
_compute: ComputeThread | _CallerThread | None = None


def compute() -> ComputeThread | _CallerThread:
    """The process's compute thread (started on first use with the caller's torch thread count)."""
    global _compute
    if _compute is None:
        with _lock:
            if _compute is None:
                _compute = _CallerThread() if _env_off() else ComputeThread(torch.get_num_threads())
    return _compute


def use_caller_thread() -> None:
    """Run engine work on the calling thread from now on (for processes that run their own multi-threaded torch
    work on one thread, e.g. training); a compute thread already started is stopped."""
    global _compute
    with _lock:
        if isinstance(_compute, ComputeThread):
            _compute.stop()
        _compute = _CallerThread()


def set_compute_threads(threads: int) -> None:
    """Set the torch thread count of the thread that runs the engine's passes (``torch.set_num_threads`` there)."""
    compute().set_threads(threads)


def compute_threads() -> int:
    """The torch thread count engine passes run with."""
    engine_compute = compute()
    return torch.get_num_threads() if isinstance(engine_compute, _CallerThread) else engine_compute.threads


@contextmanager
def single_threaded() -> Iterator[None]:
    """Torch ops in this block use one thread (unless this is the compute thread, or engine work runs on the
    calling thread): small ops on a decode thread must not start an OpenMP pool of their own."""
    engine_compute = compute()
    if engine_compute.on_thread():
        yield
        return
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _env_off() -> bool:
    return os.environ.get(ENV_COMPUTE_THREAD, "1").strip().lower() in ("0", "false", "off", "no")


__all__ = [
    "ENV_COMPUTE_THREAD",
    "ComputeThread",
    "compute",
    "compute_threads",
    "set_compute_threads",
    "single_threaded",
    "use_caller_thread",
]
