"""What a compiled graph depends on and what it remembers: the pass's cache key covers everything the
backend choice reads, a preference changed after compiling is reported, and decisions() answers for
graphs Inductor serves from its cache."""

import logging
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import mla_inductor
from mla_inductor.lowering import decisions, installed_pass, records
from mla_inductor.selection import BACKEND_ENV
from mla_inductor.testing import make_decode_inputs

ARGS = make_decode_inputs([5, 9], num_heads=3, kv_lora_rank=32, rope_dim=16, page_size=4,
                          q_dtype=torch.float32).args()


def step(*args):
    return torch.ops.mla.paged_decode(*args) * 2


def compile_and_run(fn=step, args=ARGS):
    """A fresh Dynamo compile (Inductor's caches as configured) and one run; returns (hits, misses)."""
    torch._dynamo.reset()
    counters.clear()
    torch.compile(fn, fullgraph=True)(*args)
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def forget_decisions():
    """As a new process would start: nothing decided, no compiled graph seen."""
    records._decisions.clear()
    records._records.clear()


@pytest.fixture
def fx_cache():
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        yield


@pytest.mark.parametrize("variable,values", [("TRITON_INTERPRET", ("1", "0")), ("MLA_INDUCTOR_DEBUG", ("0", "1"))])
def test_pass_uuid_covers_the_environment_selection_reads(variable, values, monkeypatch):
    """TRITON_INTERPRET decides whether Triton runs CPU tensors (its supports()); MLA_INDUCTOR_DEBUG whether
    GPU graphs get value checks. A graph compiled under one value must not be served under the other."""
    uuids = []
    for value in values:
        monkeypatch.setenv(variable, value)
        uuids.append(installed_pass().uuid())
        assert installed_pass().uuid() == uuids[-1], "uuid must be stable for the FX graph cache to hit"
    assert uuids[0] != uuids[1]


@pytest.mark.slow
def test_fx_cache_misses_when_triton_interpret_changes(fx_cache, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_and_run() == (0, 1)
    assert compile_and_run() == (1, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert compile_and_run() == (0, 1)


def test_decisions_and_their_log_survive_an_fx_cache_hit(fx_cache, caplog):
    forget_decisions()
    assert compile_and_run() == (0, 1)
    compiled = decisions()
    assert [d.backend for d in compiled] == ["reference"]
    forget_decisions()
    with caplog.at_level(logging.INFO, logger="mla_inductor.lowering"):
        assert compile_and_run() == (1, 0)  # the pass did not run: the graph came from the cache
    assert decisions() == compiled
    logged = [r.getMessage() for r in caplog.records if r.name == "mla_inductor.lowering"]
    assert len(logged) == 1 and "-> reference" in logged[0] and "Inductor's cache" in logged[0], logged


def preference_warnings(run) -> list[str]:
    """The messages of the preference warnings ``run()`` gives (torch's own warnings while it compiles
    are no concern here)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in seen if "a compiled graph chose its MLA backends" in str(w.message)]


def test_preference_changed_after_compiling_warns_once(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    compiled = torch.compile(step, fullgraph=True)
    torch._dynamo.reset()
    results = []
    assert preference_warnings(lambda: results.extend([compiled(*ARGS), compiled(*ARGS)])) == []
    with pytest.warns(UserWarning, match=r"under the backend preference None; the preference is now \('reference',\)"):
        with mla_inductor.prefer_backends("reference"):
            compiled(*ARGS)
    with mla_inductor.prefer_backends("reference"):  # once per graph
        assert preference_warnings(lambda: results.append(compiled(*ARGS))) == []
    torch.testing.assert_close(results[-1], results[0])


def test_preference_set_by_environment_after_compiling_warns(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    compiled = torch.compile(lambda *a: step(*a) + 1, fullgraph=True)
    torch._dynamo.reset()
    compiled(*ARGS)
    monkeypatch.delenv(BACKEND_ENV)
    with pytest.warns(UserWarning, match=r"under the backend preference \('reference',\); the preference is now None"):
        compiled(*ARGS)


@pytest.mark.slow
def test_decisions_made_lists_every_decision_of_the_block_repeats_included():
    """decisions() keeps each distinct choice once; decisions_made() lists what the graphs compiled inside the
    block decided, also a choice an earlier graph made already (how a benchmark tells which backend a
    recompiled graph runs)."""
    from mla_inductor.lowering import decisions_made

    # Every compile lowered afresh (a graph served from Inductor's cache whose record this process made decides
    # nothing anew).
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=False):
        compile_and_run()  # the choice is known before the block
        known = len(decisions())
        with decisions_made() as made:
            compile_and_run()
            compile_and_run()
        with decisions_made() as outer, decisions_made() as inner:
            compile_and_run()
    assert len(decisions()) == known  # nothing new to decisions()
    assert len(made) == 2 and made[0] == made[1] and made[0] in decisions()
    assert len(outer) == len(inner) == 1
    with decisions_made() as idle:
        step(*ARGS)  # eager: the pass decides nothing
    assert idle == []


def test_the_record_is_called_without_the_dispatcher():
    """The record op runs on every call of a graph compiled without CUDA graphs (once per call of a one-call
    graph): the generated code calls it itself, so the profiler, which records every op the dispatcher runs,
    records none, and it still does its work (the warning of the tests above)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    _, code = run_and_get_code(compiled, *ARGS)
    assert code[0].count("extern_kernels.mla_direct.mla.compiled_with.default(") == 1, code[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compiled(*ARGS)
    recorded = {event.key for event in profile.key_averages()}
    assert not any("compiled_with" in key for key in recorded) and "mla::check_decode_values" in recorded, recorded
