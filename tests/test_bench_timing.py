"""``benchmarks/timing.py``, the one timing helper of the benchmarks: each function runs the program it says
(how many calls, which of them timed), on CPU."""

from benchmark_modules import load_benchmark


def _counter():
    calls = []
    return calls, lambda: calls.append(None)


def test_mean_ms_times_iters_calls_after_warmup():
    timing = load_benchmark("timing")
    calls, fn = _counter()
    assert timing.mean_ms(fn, "cpu", warmup=3, iters=5) >= 0 and len(calls) == 8


def test_median_ms_on_cpu_is_three_calls_after_one():
    timing = load_benchmark("timing")
    calls, fn = _counter()
    assert timing.median_ms(fn, "cpu") >= 0 and len(calls) == 4


def test_host_seconds_and_median_seconds_run_what_they_time():
    timing = load_benchmark("timing")
    calls, fn = _counter()
    assert timing.host_seconds(fn, 7, warmup=2, device="cpu") >= 0 and len(calls) == 9
    calls.clear()
    befores, before = _counter()
    synced, sync = _counter()
    assert timing.median_seconds(fn, 4, warmup=3, before=before, sync=sync) >= 0
    assert len(calls) == len(befores) == len(synced) == 7
    calls.clear()
    assert timing.wall_seconds(fn, "cpu") >= 0 and len(calls) == 1
