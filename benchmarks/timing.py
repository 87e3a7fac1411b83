"""How the benchmarks time things, in one place.

- ``median_ms``: triton's ``do_bench`` median on a GPU (CUDA events around each call, L2 flushed before it,
  warm-up 25 ms, 200 ms of calls), the way every peer is timed; on CPU (where no benchmark's figures are
  reported, only its program checked) the median of three calls after a warm-up.
- ``graph_median_ms``: triton's ``do_bench_cudagraph`` median: the call captured in a CUDA graph and replayed.
- ``mean_ms``: the mean of ``iters`` back-to-back calls after ``warmup`` ones, the device synchronised around
  the timed loop only (a run of decode steps as a serving loop issues them).
- ``wall_seconds``: one call, the device synchronised at both ends (a whole ``generate()``, a first compiled
  step).
- ``host_seconds``: the host's time per call of ``calls`` back-to-back calls (what issuing the work costs the
  host), the device synchronised every ``sync_every`` calls and at the end outside the clock, so that its
  queue never fills.
- ``median_seconds``: the median wall time of single calls, each followed by a caller's sync, with Python's
  garbage collector off (the host time a call adds, per call).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional

import torch


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device="cuda", *, warmup: int = 25, rep: int = 200) -> float:
    """Median ms per call of ``fn``: ``triton.testing.do_bench`` on a GPU; on CPU the median of three
    wall-clock calls after one warm-up call."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    return statistics.median(1e3 * wall_seconds(fn, device) for _ in range(3))


def graph_median_ms(fn: Callable[[], object], *, rep: int = 200) -> float:
    """Median ms per replay of ``fn`` captured in a CUDA graph (``triton.testing.do_bench_cudagraph``)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def mean_ms(fn: Callable[[], object], device, *, warmup: int, iters: int) -> float:
    """Mean wall time of ``fn()`` in ms over ``iters`` back-to-back calls after ``warmup`` calls, the device
    synchronised before and after the timed loop (not between calls)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start) / iters


def wall_seconds(fn: Callable[[], object], device) -> float:
    """Seconds one call of ``fn`` takes, the device synchronised before and after it."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def host_seconds(fn: Callable[[], object], calls: int, *, warmup: int = 0, sync_every: Optional[int] = None,
                 device="cuda") -> float:
    """The host's seconds per call over ``calls`` back-to-back calls of ``fn`` (after ``warmup`` calls): the
    clock stops when the last call returns, before the device has run it; every ``sync_every`` calls the
    device is waited for inside the clock (None: never), so a long loop cannot fill its launch queue."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for i in range(calls):
        fn()
        if sync_every is not None and i % sync_every == sync_every - 1:
            synchronize(device)
    elapsed = time.perf_counter() - start
    synchronize(device)
    return elapsed / calls


def median_seconds(fn: Callable[[], object], repeats: int, *, warmup: int = 3,
                   before: Optional[Callable[[], None]] = None, sync: Callable[[], None] = lambda: None) -> float:
    """Median over ``repeats`` calls (after ``warmup`` untimed ones) of the wall time from calling ``fn`` to
    ``sync()`` returning, ``before()`` run outside the clock ahead of each call, with Python's garbage collector
    off so that a collection does not land in one call."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + repeats):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times)
