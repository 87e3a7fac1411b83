"""Measured selection on a GPU: real timings in each program shape, the bound on a new class's cost, stored
results read by a later compile without timing, and decisions() saying which decisions were measured."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

import mla_inductor
from mla_inductor import tuning
from mla_inductor.backends import availability, device_capability
from mla_inductor.contract import DecodeProblem
from mla_inductor.selection import CallContext, select_backend
from mla_inductor.testing import make_decode_inputs

pytestmark = pytest.mark.gpu

CONTEXTS = {"captured": CallContext(61, True), "uncaptured": None, "one-call": CallContext(1, False),
            "one-call-captured": CallContext(1, True)}
SECONDS_PER_CLASS = 5.0  # the cost bound a new problem class may take at compile time


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuning, "_files", {})
    return tmp_path


def _problem(fmt="bf16", heads=16, batch=32):
    return DecodeProblem(device_type="cuda", cache_format=fmt, q_dtype=torch.bfloat16, num_heads=heads,
                         kv_lora_rank=512, rope_dim=64, page_size=64, sparse=False, q_per_seq=1, batch=batch)


@pytest.mark.parametrize("program", list(CONTEXTS))
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_each_program_shape_is_timed_within_the_bound_and_then_read(fresh_store, program, fmt):
    capability = device_capability(torch.device("cuda"))
    before = tuning.timing_count()
    started = time.perf_counter()
    with tuning.autotuning("all"):
        chosen = select_backend(_problem(fmt), capability, context=CONTEXTS[program])
    seconds = time.perf_counter() - started
    if chosen.measurement is None:
        pytest.skip(f"fewer than two usable backends for {fmt} here: {availability()}")
    assert chosen.measurement.source == "measured" and tuning.timing_count() == before + 1
    times = dict(chosen.measurement.times)
    assert len(times) >= 2 and all(us > 0 for us in times.values()), chosen.measurement.describe()
    assert times[chosen.backend] <= min(times.values()) * (1 + tuning.TIE)
    assert seconds <= SECONDS_PER_CLASS, f"{program} {fmt}: {seconds:.1f} s ({chosen.measurement.describe()})"
    tuning._files.clear()
    again = select_backend(_problem(fmt, batch=20), capability, context=CONTEXTS[program])  # same class
    assert again.backend == chosen.backend and again.measurement.source == "stored"
    assert tuning.timing_count() == before + 1


def test_a_second_process_compiling_the_same_step_times_nothing(fresh_store):
    """The first process compiles (and tunes) a step; a second one compiles it again and reads the results."""
    script = textwrap.dedent("""
        import sys, torch, torch._inductor.config, mla_inductor
        from mla_inductor import tuning
        from mla_inductor.lowering import decisions
        from mla_inductor.testing import make_decode_inputs
        x = make_decode_inputs(seq_lens=[300, 4000, 1200, 64], num_heads=16, device="cuda")
        def step(q_nope, q_pe, kv, bt, sl):
            a = torch.ops.mla.paged_decode(q_nope, q_pe, kv, bt, sl, 0.04, x.kv_scale)
            return torch.ops.mla.paged_decode(q_nope * 2, q_pe, kv, bt, sl, 0.04, x.kv_scale) + a
        with tuning.autotuning("all"), torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(step, fullgraph=True)(x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens)
        print(tuning.timing_count(), sorted({d.source for d in decisions()}))
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                           env={**__import__("os").environ, tuning.CACHE_DIR_ENV: str(fresh_store)})
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (r.stdout.strip().splitlines()[-1] for r in runs)
    if first.startswith("0 "):
        pytest.skip(f"nothing to time here (one usable backend): {first}")
    assert first.endswith("['measured']"), first
    assert second == "0 ['stored']", second


def test_eager_calls_use_the_stored_choice(fresh_store):
    x = make_decode_inputs(seq_lens=[300, 4000, 1200, 64], num_heads=16, device="cuda")
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, 0.04, x.kv_scale)
    with tuning.autotuning("all"):
        chosen = mla_inductor.backend_for_call(*args)
    if chosen.measurement is None:
        pytest.skip("fewer than two usable backends here")
    tuning._files.clear()
    count = tuning.timing_count()
    with tuning.autotuning("all"):  # the same scope of candidates: the same stored class
        again = mla_inductor.backend_for_call(*args)
    assert again.backend == chosen.backend and tuning.timing_count() == count
    out = torch.ops.mla.paged_decode(*args)
    assert torch.isfinite(out).all()
