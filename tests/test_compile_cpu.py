"""The CPU compile path: the pass turns mla.paged_decode into Inductor-generated code."""

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.testing import FileCheck

import mla_inductor
import mla_inductor.lowering
from mla_inductor.testing import make_decode_inputs, relative_error

SMALL = dict(kv_lora_rank=32, rope_dim=16, page_size=4, num_heads=3, q_dtype=torch.float32)
VARIANTS = {
    "dense": dict(seq_lens=[5, 17, 1]),
    "fp8": dict(seq_lens=[9, 3], fmt="fp8_e4m3"),
    "fp8_ds_mla": dict(seq_lens=[9, 3], fmt="fp8_ds_mla", kv_lora_rank=512, rope_dim=64),
    "sparse": dict(seq_lens=[12, 30], topk=6),
    "mtp_q2": dict(seq_lens=[6, 11], q_per_seq=2),
}


def decode_step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, sparse_indices=None):
    out, lse = torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale,
                                                   sparse_indices)
    return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale,
                                      sparse_indices) * 2, out, lse


def _inputs(variant, **extra):
    kw = {**SMALL, **VARIANTS[variant], **extra}
    x = make_decode_inputs(**kw)
    return (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale, x.sparse_indices)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compiled_matches_eager_and_calls_no_opaque_op(variant):
    torch._dynamo.reset()
    args = _inputs(variant)
    want = decode_step(*args)
    counter = CompileCounterWithBackend("inductor")
    got, code = run_and_get_code(torch.compile(decode_step, fullgraph=True, backend=counter), *args)
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-5
    # The reference became generated C++: no call of the opaque op remains, only the value checks.
    FileCheck().check("torch.ops.mla.check_decode_values").check("cpp_fused").check_not(
        "torch.ops.mla.paged_decode").run(code[0])


@pytest.mark.slow
def test_one_frame_serves_all_batch_sizes():
    """Batch-size dims marked dynamic (as a serving loop would), block table width fixed by max_seq_len."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(decode_step, fullgraph=True, backend=counter)
    for i, batch in enumerate([2, 3, 17, 64, 256]):
        lens = [(7 * b + i) % 23 + 1 for b in range(batch)]
        args = _inputs("dense", seq_lens=lens, num_heads=2, seed=i, max_pages=6)
        for t in (args[0], args[1], args[2], args[3], args[4]):  # kv_cache: its page count grows too
            torch._dynamo.mark_dynamic(t, 0)
        for g, w in zip(step(*args), decode_step(*args)):
            assert relative_error(g, w) < 1e-5
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


@pytest.mark.slow
def test_seq_lens_values_do_not_recompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(decode_step, fullgraph=True, backend=counter)
    args = list(_inputs("dense", seq_lens=[16, 16]))
    for lens in ([1, 16], [16, 0], [9, 3]):
        args[4] = torch.tensor(lens, dtype=torch.int32)
        for g, w in zip(step(*args), decode_step(*args)):
            assert relative_error(g, w) < 1e-5
    assert counter.frame_count == 1


class _ScaledAttention(torch.nn.Module):
    """softmax_scale as a model holds it: a float attribute (Hugging Face's ``self.scaling``)."""

    def __init__(self, softmax_scale: float):
        super().__init__()
        self.scaling = softmax_scale

    def forward(self, q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, self.scaling,
                                                   kv_scale)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "torch.compile(dynamic=True) makes a float a graph input (a 0-d tensor and .item()); the op's float "
    "argument specializes it, which Dynamo finds only in AOTAutograd's tensorify pass, and it restarts the "
    "frame's analysis with the float a constant: two traces on the first call. Not avoidable in the op "
    "(no aten op to tensorify into); torch._dynamo.config.specialize_float=True or dynamic=None avoid it"))
def test_dynamic_true_with_a_float_scale_traces_once():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    x = make_decode_inputs([5, 9, 3], **{**SMALL, "num_heads": 2})
    step = torch.compile(_ScaledAttention(x.softmax_scale), fullgraph=True, dynamic=True, backend=counter)
    out, lse = step(x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)
    want_out, want_lse = torch.ops.mla.paged_decode_with_lse(*x.args())
    assert relative_error(out, want_out) < 1e-5 and relative_error(lse, want_lse) < 1e-5
    assert counter.frame_count == 1, f"{counter.frame_count} traces of one frame"


@pytest.mark.slow
def test_cache_append_and_decode_compile_without_graph_breaks():
    """The compiled append writes the real cache (called without the dispatcher: ``define_op(direct=True)``)."""
    cache = mla_inductor.PagedLatentCache.allocate(num_layers=1, batch_size=2, max_seq_len=16, kv_lora_rank=32,
                                                   rope_dim=16, page_size=4)
    cache.reserve([5, 2])

    def step(kv_cache, kv_c, k_pe, slots, q_nope, q_pe, block_table, seq_lens, kv_scale):
        torch.ops.mla.cache_append(kv_cache, kv_c, k_pe, slots, kv_scale)
        return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.2, kv_scale)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for _ in range(3):
        slots = cache.reserve(1)
        new = (torch.randn(2, 32), torch.randn(2, 16), slots, torch.randn(2, 3, 32), torch.randn(2, 3, 16))
        eager_cache = cache.kv_caches[0].clone()
        want = step(eager_cache, *new[:3], *new[3:], cache.block_table, cache.seq_lens, cache.kv_scale)
        args = (cache.kv_caches[0], *new[:3], *new[3:], cache.block_table, cache.seq_lens, cache.kv_scale)
        if counter.frame_count == 0:
            got, code = run_and_get_code(compiled, *args)
            assert "extern_kernels.mla_direct.mla.cache_append.default(" in code[0], code[0]
        else:
            got = compiled(*args)
        assert torch.equal(cache.kv_caches[0], eager_cache)  # the compiled append mutated the real cache
        assert relative_error(got, want) < 1e-5
    assert counter.frame_count == 1


@pytest.mark.slow
def test_fx_graph_cache_hits_on_rerun_and_misses_when_the_choice_changes():
    args = _inputs("dense")

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(decode_step, fullgraph=True)(*args)
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        assert compile_once() == (0, 1)
        assert compile_once() == (1, 0)
        with mla_inductor.prefer_backends("reference"):  # another backend preference: another pass uuid
            assert compile_once() == (0, 1)


@pytest.mark.slow
def test_pass_is_installed_and_keeps_a_user_pass():
    from mla_inductor.lowering import installed_pass, install, uninstall

    assert installed_pass() is not None
    seen = []

    class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user-pass-v1"

    uninstall()
    try:
        torch._inductor.config.post_grad_custom_post_pass = UserPass()
        ours = install()
        assert ours.previous is torch._inductor.config.post_grad_custom_post_pass.previous
        torch._dynamo.reset()
        args = _inputs("dense")
        with fresh_cache():  # a cached graph would skip every pass
            torch.compile(decode_step, fullgraph=True)(*args)
        assert seen, "the user's pass did not run"
    finally:
        uninstall()
        torch._inductor.config.post_grad_custom_post_pass = None
        install()


@pytest.fixture
def planned_backend(monkeypatch):
    from mla_inductor import backends

    backends.register_backend("planned_test", "planned_backend")
    yield
    backends.unregister_backend("planned_test")


@pytest.mark.slow
@pytest.mark.parametrize("out_only", [False, True], ids=["run", "out_only"])
@pytest.mark.parametrize("plans_in_first_call", [False, True], ids=["plan_op", "decode_and_plan"])
def test_a_many_layer_forward_plans_once(planned_backend, plans_in_first_call, out_only, monkeypatch):
    import planned_backend as pb

    monkeypatch.setattr(pb.BACKEND, "plans_in_first_call", plans_in_first_call)
    monkeypatch.setattr(pb.BACKEND, "has_out_only", out_only)
    layers = 16  # every layer after the first reuses the first's plan: the counts below hold at any depth (61 too)
    x = make_decode_inputs(seq_lens=[5, 17, 9], **SMALL)
    caches = [x.kv_cache.clone() for _ in range(layers)]

    def forward(q_nope, q_pe, block_table, seq_lens, kv_scale, caches):
        h = q_nope
        for kv_cache in caches:
            h = h + torch.ops.mla.paged_decode(h, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)
        return h

    args = (x.q_nope, x.q_pe, x.block_table, x.seq_lens, x.kv_scale, caches)
    torch._dynamo.reset()
    with mla_inductor.prefer_backends("planned_test"), fresh_cache():
        got, code = run_and_get_code(torch.compile(forward, fullgraph=True), *args)
    assert relative_error(got, forward(*args)) < 1e-5
    runs, plans = code[0].count("torch.ops.mla_test.run.default("), code[0].count("torch.ops.mla_test.plan.default(")
    merged = code[0].count("torch.ops.mla_test.decode_and_plan.default(")
    outs = code[0].count("torch.ops.mla_test.run_out.default(")
    # With decode_and_plan the first layer makes the plan while decoding; no separate plan runs. Nothing
    # reads paged_decode's lse, so a backend offering an out-only op gets it for every other layer.
    later = (layers - 1, 0, 1) if plans_in_first_call else (layers, 1, 0)
    assert (outs if out_only else runs, plans, merged) == later and (runs if out_only else outs) == 0


def test_calls_reading_lse_keep_the_run_op(planned_backend, monkeypatch):
    import planned_backend as pb

    monkeypatch.setattr(pb.BACKEND, "has_out_only", True)
    x = make_decode_inputs(seq_lens=[5, 17, 9], **SMALL)

    def two_calls(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        out, lse = torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)
        return torch.ops.mla.paged_decode(out, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale), lse

    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)
    torch._dynamo.reset()
    with mla_inductor.prefer_backends("planned_test"), fresh_cache():
        got, code = run_and_get_code(torch.compile(two_calls, fullgraph=True), *args)
    want = two_calls(*args)
    assert relative_error(got[0], want[0]) < 1e-5 and relative_error(got[1], want[1]) < 1e-5
    calls = [line for line in code[0].splitlines() if "= torch.ops.mla_test." in line]
    assert [c.split("torch.ops.mla_test.")[1].split("(")[0] for c in calls] == ["plan.default", "run.default",
                                                                               "run_out.default"], calls


@pytest.mark.slow
def test_unbacked_batch_sizes_serve_b1_to_256_in_one_frame():
    """mark_unbacked batch dims: no 0/1 specialisation, so B=1 shares the frame with B=256."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(decode_step, fullgraph=True, backend=counter)
    for i, batch in enumerate([1, 2, 7, 256]):
        lens = [(5 * b + i) % 15 + 1 for b in range(batch)]
        args = _inputs("dense", seq_lens=lens, num_heads=2, seed=i, max_pages=4)
        torch._dynamo.mark_dynamic(args[2], 0)
        for t in (args[0], args[1], args[3], args[4]):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        for g, w in zip(step(*args), decode_step(*args)):
            assert relative_error(g, w) < 1e-5
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_pass_uuid_changes_with_preference_autotune_and_library_versions(monkeypatch):
    import mla_inductor.backends as backends
    from mla_inductor.tuning import autotuning
    from mla_inductor.lowering import installed_pass

    ours = installed_pass()
    base = ours.uuid()
    assert base == ours.uuid(), "uuid must be stable for the FX graph cache to hit"
    with mla_inductor.prefer_backends("triton", "reference"):
        assert ours.uuid() != base
    with autotuning(True):
        assert ours.uuid() != base
    installed = backends.library_version
    monkeypatch.setattr(backends, "library_version", lambda name: "0.0.1" if name == "vllm" else installed(name))
    first = ours.uuid()
    monkeypatch.setattr(backends, "library_version", lambda name: "0.0.2" if name == "vllm" else installed(name))
    assert first != base and ours.uuid() not in (base, first)
    monkeypatch.setattr(backends, "library_version", installed)
    # Code cached with direct calls needs them arranged (bench_modes --dispatcher-calls keeps them off).
    from mla_inductor import _library

    assert ours.uuid() == base
    monkeypatch.setattr(_library, "_DIRECT_WATCHERS", [])
    assert ours.uuid() != base


@pytest.mark.parametrize("plans_in_first_call", [False, True], ids=["plan_op", "decode_and_plan"])
def test_optional_plan_is_dropped_when_one_call_would_use_it(planned_backend, plans_in_first_call, monkeypatch):
    import planned_backend as pb

    monkeypatch.setattr(pb.BACKEND, "plan_is_optional", True)
    monkeypatch.setattr(pb.BACKEND, "plans_in_first_call", plans_in_first_call)
    x = make_decode_inputs(seq_lens=[5, 17, 9], **SMALL)
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)

    def one_call(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)

    def two_calls(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        h = one_call(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale)
        return one_call(h, q_pe, kv_cache, block_table, seq_lens, kv_scale)

    with mla_inductor.prefer_backends("planned_test"), fresh_cache():
        for fn, plans in ((one_call, 0), (two_calls, 1)):
            torch._dynamo.reset()
            got, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
            assert relative_error(got, fn(*args)) < 1e-5
            made = code[0].count("torch.ops.mla_test.plan.default(") + code[0].count(
                "torch.ops.mla_test.decode_and_plan.default(")
            assert made == plans, fn.__name__


# ----------------------------------------------------------------------------- calls without the dispatcher

DIRECT_CALLS: list[type] = []  # the type of softmax_scale of each call of _direct_run


def _direct_run(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices, plan):
    DIRECT_CALLS.append(type(softmax_scale))
    out, lse = mla_inductor.paged_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                                   kv_scale, sparse_indices)
    return out.contiguous(), lse.contiguous()


class _DirectBackend(mla_inductor.backends.Backend):
    """A backend whose run op is defined as every built-in backend's (``decode_op``)."""

    name = "direct_test"
    op = None

    def supports(self, problem, capability):
        return None

    def compiled_op(self):
        if _DirectBackend.op is None:
            from mla_inductor.backends._common import decode_op

            _DirectBackend.op = decode_op("mla_direct_test::run", _direct_run)
        return _DirectBackend.op

    def decode(self, *args):
        return self.compiled_op()(*args, [])


def test_compiled_code_calls_backend_ops_without_the_dispatcher():
    """The ops the pass writes (a backend's ``decode_op``) are called by the generated code itself, named under
    ``extern_kernels.mla_direct`` (the dispatcher's part of a call costs as much as a short kernel's host work),
    even when defined after the pass was installed; the results are the reference's, and the profiler, which
    records every op the dispatcher runs, records none of these calls."""
    backends = mla_inductor.backends
    backends.register_backend("direct_test", _DirectBackend())
    try:
        args = _inputs("dense")
        torch._dynamo.reset()
        with mla_inductor.prefer_backends("direct_test"), fresh_cache():
            step = torch.compile(decode_step, fullgraph=True)
            got, code = run_and_get_code(step, *args)
            assert code[0].count("= extern_kernels.mla_direct.mla_direct_test.run.default(") == 2, code[0]
            assert "= torch.ops.mla_direct_test" not in code[0]  # (named in size asserts and comments)
            del DIRECT_CALLS[:]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                again = step(*args)
        recorded = {event.key for event in profile.key_averages()}
        assert DIRECT_CALLS == [float, float] and not any("mla_direct_test" in key for key in recorded), recorded
        assert "mla::paged_decode" not in recorded and "aten::empty_strided" in recorded, recorded  # it records
        want = [mla_inductor.paged_decode_reference(*args[:5], 0.125, *args[5:])[i] for i in (0, 0, 1)]
        want[0] = want[0] * 2
        for result in (got, again):
            for g, w in zip(result, want):
                assert relative_error(g, w) < 1e-5
        # A scale given as a bool reaches the op as the float its schema names (the dispatcher's
        # conversion, which a direct call skips, is made when the call is traced).
        def bool_scale(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
            return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, True, kv_scale)

        del DIRECT_CALLS[:]
        with mla_inductor.prefer_backends("direct_test"), fresh_cache():
            got = torch.compile(bool_scale, fullgraph=True)(*args[:6])
        assert DIRECT_CALLS == [float]
        assert relative_error(got, mla_inductor.paged_decode_reference(*args[:5], 1.0, args[5])[0]) < 1e-5
    finally:
        backends.unregister_backend("direct_test")


SITES_MADE = []


class _Site:
    """A call site's callable (``decode_op``'s ``call_site``): keeps the facts it was made from, counts its calls."""

    def __init__(self, facts):
        self.facts, self.calls = facts, 0
        SITES_MADE.append(self)

    def __call__(self, *args):
        self.calls += 1
        return _direct_run(*args)


class _SiteBackend(_DirectBackend):
    name = "site_test"
    op = None

    def compiled_op(self):
        if _SiteBackend.op is None:
            from mla_inductor.backends._common import decode_op

            _SiteBackend.op = decode_op("mla_site_test::run", _direct_run, call_site=_Site)
        return _SiteBackend.op


def test_static_call_sites_call_their_own_callable_and_symbolic_ones_the_op():
    """A backend op with a ``call_site``: each call of a graph whose sizes are static calls the callable made for
    its site from the site's facts (dtype, device and shape of every tensor, the scalars); a call whose sizes are
    symbolic (``dynamic=True``) calls the op's implementation. Results are the reference's either way."""
    from mla_inductor._library import StaticTensor

    backends = mla_inductor.backends
    backends.register_backend("site_test", _SiteBackend())
    try:
        args = _inputs("dense")
        want = decode_step(*args)
        for dynamic in (False, True):
            torch._dynamo.reset()
            del SITES_MADE[:], DIRECT_CALLS[:]
            with mla_inductor.prefer_backends("site_test"), fresh_cache():
                got, code = run_and_get_code(torch.compile(decode_step, fullgraph=True, dynamic=dynamic), *args)
            for g, w in zip(got, want):
                assert relative_error(g, w) < 1e-5
            sites = code[0].count("= extern_kernels.mla_direct.mla_site_test.run.site_default_")
            direct = code[0].count("= extern_kernels.mla_direct.mla_site_test.run.default(")
            assert (sites, direct) == ((0, 2) if dynamic else (2, 0)), code[0]
            # (static: the sites' callables ran, the implementation only through them)
            assert DIRECT_CALLS == [float] * 2 and sum(s.calls for s in SITES_MADE) == (0 if dynamic else 2)
            if not dynamic:
                facts = SITES_MADE[0].facts
        q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, _ = args
        assert facts[:5] == tuple(StaticTensor(t.dtype, t.device, tuple(t.shape))
                                  for t in (q_nope, q_pe, kv_cache, block_table, seq_lens))
        assert facts[5:] == (0.125, StaticTensor(kv_scale.dtype, kv_scale.device, tuple(kv_scale.shape)), None, [])
    finally:
        backends.unregister_backend("site_test")


def test_call_site_names_hold_their_facts():
    """The name of a site in generated code is an identifier from which a new process reads its facts back."""
    from mla_inductor._library import StaticTensor, call_site_facts, call_site_name

    facts = (StaticTensor(torch.bfloat16, torch.device("cuda", 1), (1, 128, 512)), 0.1352337788608801, None,
             [StaticTensor(torch.int32, torch.device("cpu"), (7,))], torch.float8_e4m3fn, 3, True, "x")
    name = call_site_name(facts)
    assert name.isidentifier() and name.isalnum() and call_site_facts(name) == facts
    assert call_site_facts(call_site_name(facts[:1] + (0.1,))) != facts[:1] + (0.1352337788608801,)


def test_a_site_named_where_the_op_has_no_call_site_is_its_implementation():
    """Code loaded from Inductor's cache may name a call site in a process that arranged the op's calls without
    sites (``bench_modes --no-call-sites``): the name then gives the op's implementation (the same results), and
    a name of no op's overload is an AttributeError."""
    from mla_inductor._library import StaticTensor, call_site_name
    from mla_inductor.lowering._compat import _Namespace

    def impl(*args):
        return args

    facts = (StaticTensor(torch.float32, torch.device("cpu"), (2, 3)), 0.5)
    ops = _Namespace()
    ops.default = impl
    assert getattr(ops, f"site_default_{call_site_name(facts)}") is impl
    with pytest.raises(AttributeError):
        getattr(ops, f"site_other_{call_site_name(facts)}")
    with pytest.raises(AttributeError):
        ops.anything_else
    ops._call_sites = {"default": (impl, lambda got: (lambda *args: ("site", got)))}
    assert getattr(ops, f"site_default_{call_site_name(facts[:1])}")() == ("site", facts[:1])


def test_a_call_that_attends_nothing_by_its_static_sizes_gets_no_site():
    """``decode_op`` asks a backend's ``call_site`` only for calls that attend something: the op's implementation
    returns the contract's result for the others (``attends_nothing``)."""
    from mla_inductor._library import StaticTensor, _DIRECT_IMPLS

    op = _SiteBackend().compiled_op()
    _, site = _DIRECT_IMPLS[op]
    cpu = torch.device("cpu")

    def facts(rows, width):
        return (StaticTensor(torch.float32, cpu, (rows, 3, 32)), StaticTensor(torch.float32, cpu, (rows, 3, 16)),
                StaticTensor(torch.float32, cpu, (9, 4, 48)), StaticTensor(torch.int32, cpu, (rows, width)),
                StaticTensor(torch.int32, cpu, (rows,)), 0.125, StaticTensor(torch.float32, cpu, (1,)), None, [])

    assert site(facts(0, 3)) is None and site(facts(2, 0)) is None
    assert isinstance(site(facts(2, 3)), _Site)


_CACHED_STEP = """
import torch
from torch._dynamo.utils import counters
import mla_inductor
from mla_inductor.testing import make_decode_inputs, relative_error

x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4, q_dtype=torch.float32)
args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)

def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
    return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)

with mla_inductor.prefer_backends("triton"):
    got = torch.compile(step, fullgraph=True)(*args)
want = mla_inductor.paged_decode_reference(*args[:5], 0.125, args[5])[0]
from torch._inductor.select_algorithm import extern_kernels
calls = vars(extern_kernels.mla_direct.mla_triton.decode_out_keeping_workspace)
print("hits", counters["inductor"]["fxgraph_cache_hit"], "error", relative_error(got, want),
      "sites", sum(name.startswith("site_") for name in calls))
"""


@pytest.mark.slow
def test_a_graph_loaded_from_the_cache_in_a_new_process_finds_its_direct_calls(tmp_path):
    """Compiled code that calls a backend's op without the dispatcher, saved in Inductor's FX graph cache and
    loaded by another process (which has compiled nothing): the op's direct name is there before the code
    runs, its call site's callable is made from the name the code calls it by, and the result is the
    reference's."""
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TRITON_INTERPRET="1")
    runs = [subprocess.run([sys.executable, "-c", _CACHED_STEP], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (hits0, err0, sites0), (hits1, err1, sites1) = [run.stdout.split()[1::2] for run in runs]
    assert (hits0, hits1) == ("0", "1") and float(err0) < 1e-5 and float(err1) < 1e-5, [r.stdout for r in runs]
    assert (sites0, sites1) == ("1", "1"), [r.stdout for r in runs]


_DISPATCHER_AB = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import bench_modes
getattr(bench_modes, sys.argv[2])()
from torch._inductor.utils import run_and_get_code
import mla_inductor
from mla_inductor.testing import make_decode_inputs

x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4, q_dtype=torch.float32)
def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
    return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)
with mla_inductor.prefer_backends("triton"):
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), x.q_nope, x.q_pe, x.kv_cache, x.block_table,
                               x.seq_lens, x.kv_scale)
print("direct", "= extern_kernels.mla_direct." in code[0], "dispatcher", "= torch.ops.mla_triton." in code[0],
      "sites", ".site_default_" in code[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("switch,want", [("calls_through_the_dispatcher", ["False", "True", "False"]),
                                         ("calls_without_sites", ["True", "False", "False"])])
def test_bench_modes_ab_switches_compile_what_they_say(switch, want):
    """``bench_modes --dispatcher-calls`` (the A/B of direct calls) really gives the generated code dispatcher calls,
    and ``--no-call-sites`` (the A/B of call sites) direct calls of the op's implementation; each refuses once the
    pass is loaded (this process: its calls are arranged already)."""
    import subprocess
    import sys

    from benchmark_modules import BENCHMARKS, load_benchmark

    run = subprocess.run([sys.executable, "-c", _DISPATCHER_AB, str(BENCHMARKS), switch], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["direct", want[0], "dispatcher", want[1], "sites", want[2]], run.stdout
    with pytest.raises(RuntimeError, match="pass is loaded already"):
        getattr(load_benchmark("bench_modes"), switch)()


def test_bench_modes_no_kept_views_makes_views_on_every_call():
    """``bench_modes --no-kept-views`` (the A/B of kept cache views): each call makes its views again."""
    import subprocess
    import sys

    from benchmark_modules import BENCHMARKS

    script = ("import sys; sys.path.insert(0, sys.argv[1]); import torch, bench_modes\n"
              "from mla_inductor.backends._common import VIEWS\n"
              "cache = torch.randn(2, 4, 8)\n"
              "def views():\n"
              "    return VIEWS.get(cache, 'halves', lambda t: t.split_with_sizes((6, 2), -1))\n"
              "kept = views() is views()\n"
              "bench_modes.views_made_per_call()\n"
              "again = views()\n"
              "print(kept, again is views(), torch.equal(again[1], cache[..., 6:]))")
    run = subprocess.run([sys.executable, "-c", script, str(BENCHMARKS)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "False", "True"], run.stdout


def test_bench_modes_no_eager_repeat_builds_every_calls_signature(monkeypatch):
    """``bench_modes --no-eager-repeat`` (the A/B of an eager call repeating the op's last decision): every call
    builds its signature."""
    from benchmark_modules import load_benchmark

    from mla_inductor import ops
    from mla_inductor._memo import Memo

    signatures = []
    full = ops.call_signature
    monkeypatch.setattr(ops, "call_signature", lambda *a: signatures.append(1) or full(*a))
    monkeypatch.setattr(ops, "tensor_properties_check", ops.tensor_properties_check)  # restored afterwards
    monkeypatch.setattr(ops, "_REPEATS", {})
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4,
                           q_dtype=torch.float32, fmt="fp32")
    load_benchmark("bench_modes").signature_every_eager_call()
    for _ in range(3):
        torch.ops.mla.paged_decode(*x.args())
    assert len(signatures) == 3


@pytest.mark.slow
def test_cpp_wrapper_compiles_our_ops_and_the_record():
    """Inductor's C++ wrapper (``cpp_wrapper``, AOTInductor's codegen) compiles a graph of our ops: the pass's
    record is written as a C++ string literal (base64, no quotes to escape), and the backend's op goes through
    the dispatcher there (direct calls are for the Python wrapper)."""
    x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4,
                           q_dtype=torch.float32)
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)

    torch._dynamo.reset()
    with mla_inductor.prefer_backends("triton"), torch._inductor.config.patch(cpp_wrapper=True), fresh_cache():
        got, code = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    code = "\n".join(code)
    assert '"mla_triton::decode_out_keeping_workspace"' in code and "mla_direct" not in code, code[-3000:]
    want = mla_inductor.paged_decode_reference(*args[:5], 0.125, args[5])[0]
    assert relative_error(got, want) < 1e-5
    assert "triton" in {d.backend for d in mla_inductor.lowering.decisions()}


@pytest.mark.slow
def test_freezing_compiles_a_module_with_its_cache_as_buffers():
    """``torch._inductor.config.freezing`` (inference compiles of modules) puts constants before some graph
    inputs; the pass's record still goes after every input it may read, and a cache written in place between
    calls is read by the next one (buffers are not folded in)."""
    x = make_decode_inputs(seq_lens=[5, 9], **SMALL)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("kv_cache", "block_table", "seq_lens", "kv_scale"):
                self.register_buffer(name, getattr(x, name).clone())

        def forward(self, q_nope, q_pe):
            return torch.ops.mla.paged_decode(q_nope, q_pe, self.kv_cache, self.block_table, self.seq_lens, 0.125,
                                              self.kv_scale)

    layer = Layer().eval()

    def reference():
        return mla_inductor.paged_decode_reference(x.q_nope, x.q_pe, layer.kv_cache, layer.block_table,
                                                   layer.seq_lens, 0.125, layer.kv_scale)[0]

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True), fresh_cache():
        step = torch.compile(layer, fullgraph=True)
        assert relative_error(step(x.q_nope, x.q_pe), reference()) < 1e-5
        layer.kv_cache.mul_(2.0)  # a decode step writes the cache in place
        assert relative_error(step(x.q_nope, x.q_pe), reference()) < 1e-5


@pytest.mark.slow
def test_aot_inductor_packages_and_loads_a_model_of_our_op(tmp_path):
    """``torch.export`` then AOTInductor (``aoti_compile_and_package``, C++ wrapper, a package file) of a module
    calling our op, loaded back and run: the reference's result."""
    x = make_decode_inputs(seq_lens=[5, 9], num_heads=2, kv_lora_rank=256, rope_dim=32, page_size=4,
                           q_dtype=torch.float32)
    args = (x.q_nope, x.q_pe, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)

    class Step(torch.nn.Module):
        def forward(self, q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale):
            return torch.ops.mla.paged_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)

    exported = torch.export.export(Step(), args)
    with mla_inductor.prefer_backends("triton"), fresh_cache():
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "step.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    want = mla_inductor.paged_decode_reference(*args[:5], 0.125, args[5])[0]
    assert relative_error(loaded(*args), want) < 1e-5


def test_a_symbolic_batch_decision_names_its_size_class_and_the_traced_batch():
    """B=5 compiled with a symbolic batch is selected as its size class (problem.batch is the class's upper
    limit, 8): printed, the decision says so instead of reading as a batch of 8."""
    x = make_decode_inputs(seq_lens=[5, 9, 3, 7, 11], fmt="fp32", **SMALL)
    step = torch.compile(lambda *a: torch.ops.mla.paged_decode(*a), dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    with mla_inductor.lowering.decisions_made() as made:
        step(*x.args())
    assert made and made[0].problem.batch == 8, made
    for shown in (str(made[0]), repr(made[0]), str(made)):
        assert "batch class B<=8 (traced B=5, symbolic" in shown and "batch=8" not in shown, shown
