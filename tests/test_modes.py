"""The op in every way a user runs it, checked on any machine:

- dynamic shapes select like static ones: graphs traced on fake CUDA tensors with symbolic sizes (the
  capability faked, every backend treated as installed), and torch.compile's automatic dynamic,
  ``dynamic=True`` and ``mark_dynamic`` on CPU tensors, whose calls the pass records and which are then
  selected for an H100;
- one plan per step however the step is split (separately compiled regions, eager calls), and a new one
  after seq_lens changes;
- a one-call graph's selection names the plan cost it could not amortize.

The same modes on a GPU, kernels and syncs included: tests/test_modes_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.testing import FileCheck

import mla_inductor
from mla_inductor._memo import Memo
from mla_inductor.backends import flashmla, registered_backends
from mla_inductor.selection import CallContext, compiling_for_capture, select_backend
from mla_inductor.testing import make_decode_inputs, relative_error

EVERYTHING = {name: None for name in registered_backends()}
SM90 = (9, 0)
H, PAGES = 16, 8
FORMATS = {"bf16": (torch.bfloat16, 576), "fp8_e4m3": (torch.float8_e4m3fn, 576)}
# Small calls compile fast on CPU; their recorded problems are selected with DeepSeek's dims (``on_h100``).
SMALL = dict(kv_lora_rank=32, rope_dim=16, page_size=4, num_heads=3, q_dtype=torch.bfloat16, fmt="bf16")


def on_h100(problem):
    """A problem recorded on CPU with SMALL's dims, as the same call with DeepSeek-V3's dims on an H100."""
    assert (problem.kv_lora_rank, problem.rope_dim, problem.page_size, problem.num_heads) == (32, 16, 4, 3), problem
    return dataclasses.replace(problem, device_type="cuda", kv_lora_rank=512, rope_dim=64, page_size=64, num_heads=H)


@pytest.fixture
def fake_sm90(monkeypatch):
    """An H100 with every backend library installed, as the pass sees it."""
    from mla_inductor import backends
    from mla_inductor.lowering import graph_pass

    monkeypatch.setattr(backends, "availability", lambda: dict(EVERYTHING))
    monkeypatch.setattr(flashmla, "metadata_shape", lambda *args: (132, 8))  # measured on the GPU otherwise
    monkeypatch.setattr(graph_pass, "device_capability", lambda device: SM90)


def layers(n: int):
    """A step of ``n`` decode calls sharing block_table / seq_lens, each on its own cache."""

    def step(q_nope, q_pe, block_table, seq_lens, kv_scale, *caches):
        h = q_nope
        for cache in caches[:n]:
            h = torch.ops.mla.paged_decode(h, q_pe, cache, block_table, seq_lens, 0.07, kv_scale)
        return h

    return step


class Sizes:
    """Sizes for fake tensors: ints, or backed / unbacked SymInts of one ShapeEnv (what Dynamo makes for
    ``dynamic=True`` / ``mark_dynamic`` and for ``mark_unbacked``)."""

    def __init__(self):
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)

    def symbolic(self, name: str, value: int):
        symbol = self.env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return self.env.create_symintnode(symbol, hint=value, source=ConstantSource(name))

    def unbacked(self):
        return self.env.create_unbacked_symint()


def lowered(calls: int, fmt: str, B, T=None, heads=H, sizes: Sizes | None = None, captured: bool = False):
    """``layers(calls)`` traced on fake CUDA tensors of these sizes, then rewritten by our pass; returns
    (generated code, the decisions it made)."""
    from torch._inductor.virtualized import V

    from mla_inductor.lowering import MLALoweringPass, decisions

    sizes = sizes or Sizes()
    dtype, width = FORMATS[fmt]
    T = B if T is None else T
    with sizes.mode:
        cuda = dict(device="cuda")
        args = [torch.empty(T, heads, 512, dtype=torch.bfloat16, **cuda),
                torch.empty(T, heads, 64, dtype=torch.bfloat16, **cuda),
                torch.zeros(B, PAGES, dtype=torch.int32, **cuda), torch.ones(B, dtype=torch.int32, **cuda),
                torch.ones(1, dtype=torch.float32, **cuda)]
        args += [torch.empty(4 * PAGES, 64, width, dtype=dtype, **cuda) for _ in range(calls)]
    gm = make_fx(layers(calls), tracing_mode="symbolic")(*args)
    before = set(decisions())
    with V.set_fake_mode(sizes.mode), sizes.mode, torch._inductor.config.patch({"triton.cudagraphs": captured}):
        MLALoweringPass()(gm.graph)
    gm.recompile()
    return gm.code, [d for d in decisions() if d not in before]


# ----------------------------------------------------------------------------- dynamic shapes choose like static


@pytest.mark.parametrize("heads", [H, 128])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_symbolic_batch_selects_like_the_static_one(fake_sm90, fmt, heads):
    """B, T and H symbolic, as ``dynamic=True`` makes them: H is fixed to its traced value by a guard, Q = T / B
    by a guard, and B (traced 12) falls in the class 8 < B <= 16 (the table's batch limits are 1, 8, 16 and 32),
    whose backend is the static B=12's; B is guarded only at the class limits where the selection changes."""
    _, (static,) = lowered(1, fmt, B=12, heads=heads)
    sizes = Sizes()
    B, T, sym_heads = sizes.symbolic("B", 12), sizes.symbolic("T", 12), sizes.symbolic("H", heads)
    code, (symbolic,) = lowered(1, fmt, B=B, T=T, heads=sym_heads, sizes=sizes)
    # fp8_e4m3 goes to a kernel keeping q in bf16 unless the call opted in to an e4m3 query (Triton on SM90);
    # a one-call bf16 graph of up to 32 sequences to Triton too (uncaptured: any H; captured: H <= 16), and
    # fp8_ds_mla at H=128 to FlashMLA.
    expected = "triton" if fmt in ("fp8_e4m3", "bf16") or heads <= 16 else "flashmla"
    assert symbolic.backend == static.backend == expected
    assert symbolic.problem == dataclasses.replace(static.problem, batch=16)  # the class 8 < B <= 16 (table limits)
    assert f"num_heads: specialized to {heads}" in symbolic.notes
    # Only the batch limits where the selection changes are guarded: uncaptured one-call bf16 graphs go to Triton
    # up to B=32 (then to FlashMLA); fp8 (q in bf16) goes to Triton at any B.
    cls = {("bf16", 16): "B <= 32", ("bf16", 128): "B <= 32"}.get((fmt, heads), "any B")
    assert f"batch: symbolic (traced 12), class {cls}" in symbolic.notes
    assert any(note.startswith("q_per_seq: specialized to 1") for note in symbolic.notes)
    guards = [str(g.expr) for g in sizes.env.guards]
    assert any(g.endswith(f", {heads})") and g.startswith("Eq(") for g in guards), guards  # H guarded
    # B's class limits are the only inequalities; B > 1 needs no guard (a symbolic size is known to be >= 2), nor
    # B > 8 here (the B <= 8 row is for captured steps only: this graph selects alike on both sides).
    limits = [g for g in guards if "<" in g or ">" in g]
    assert len(limits) == (1 if cls == "B <= 32" else 0), guards
    FileCheck().check_not("torch.ops.mla.paged_decode").check("mla_flashmla" if expected == "flashmla" else "mla_").run(code)


@pytest.mark.parametrize("traced,cls,batch", [(4, "class B <= 8", 8), (16, "class B > 8", None)])
def test_a_batch_limit_inside_the_symbolic_range_is_guarded(fake_sm90, monkeypatch, traced, cls, batch):
    """With a table distinguishing B <= 8 (a row's max_batch), a symbolic B is guarded on the side its traced
    value is on; the problem carries the class's upper limit, which the rows answer as for any B in it."""
    from mla_inductor.lowering import graph_pass

    monkeypatch.setattr(graph_pass, "batch_limits", lambda: (1, 8))
    sizes = Sizes()
    B = sizes.symbolic("B", traced)
    _, (decision,) = lowered(1, "bf16", B=B, sizes=sizes)
    assert f"batch: symbolic (traced {traced}), {cls}" in decision.notes and decision.problem.batch == batch
    guards = [str(g.expr) for g in sizes.env.guards]
    assert any("8" in g and ("<=" in g or "<" in g or ">" in g) for g in guards), guards


def test_the_batch_class_follows_the_table():
    """An eager call of static B=1 takes the row of eager calls up to B=16 (FA3 on SM90 with bf16)."""
    from mla_inductor.info import example_problem

    one = select_backend(example_problem("cuda", "bf16", False, H, 64, batch=1), SM90, available=EVERYTHING,
                         preference=())
    assert one.backend == "flashinfer_fa3"


@pytest.fixture
def planned_backend():
    import planned_backend as pb

    from mla_inductor import backends

    backends.register_backend("planned_test", "planned_backend")
    pb.PLANS.forget()
    pb.PLANS_MADE.clear()
    yield pb
    backends.unregister_backend("planned_test")


def _decisions_of(compile_and_run) -> list:
    from mla_inductor.lowering import decisions

    before = set(decisions())
    compile_and_run()
    return [d for d in decisions() if d not in before]


@pytest.mark.parametrize("mode", ["automatic", "dynamic=True", "mark_dynamic"])
def test_compile_modes_select_like_static_for_every_batch(planned_backend, mode):
    """One compiled function called at B = 4, 8, 16: each graph the pass lowers (static first under
    automatic dynamic, symbolic after) is selected, on an H100, like a graph compiled for that B alone.
    The calls run here on CPU tensors, on the planned test backend (an opaque op: nothing for Inductor to
    compile to C++), checked against eager; the problems the pass recorded are what is selected."""
    torch._dynamo.reset()
    kw = SMALL
    compiled = torch.compile(layers(1), dynamic=True if mode == "dynamic=True" else None)
    from torch._inductor.utils import fresh_cache

    def run_all():
        with fresh_cache(), mla_inductor.prefer_backends("planned_test"):  # a cached graph would skip the pass
            for i, B in enumerate((4, 8, 16)):
                x = make_decode_inputs(seq_lens=[(7 * b + i) % 11 + 1 for b in range(B)], max_pages=3, seed=i, **kw)
                args = (x.q_nope, x.q_pe, x.block_table, x.seq_lens, x.kv_scale, x.kv_cache)
                if mode == "mark_dynamic":
                    for t in args[:4]:
                        torch._dynamo.mark_dynamic(t, 0)
                assert relative_error(compiled(*args), layers(1)(*args)) < 1e-2

    recorded = _decisions_of(run_all)
    assert recorded, "the pass made no decision"
    for d in recorded:
        assert None not in (d.problem.num_heads, d.problem.kv_lora_rank, d.problem.page_size, d.problem.q_per_seq), d
        problem = on_h100(d.problem)
        chosen = select_backend(problem, SM90, available=EVERYTHING, preference=(), context=d.context).backend
        for B in (4, 8, 16):
            alone = select_backend(dataclasses.replace(problem, batch=B), SM90, available=EVERYTHING, preference=(),
                                   context=d.context).backend
            # A one-call graph of up to 32 sequences with few heads: Triton (SMALL's 3 heads; selection.TABLE).
            assert chosen == alone == "triton", (d, B)
    symbolic = [d for d in recorded if any(note.startswith("batch: symbolic") for note in d.notes)]
    assert symbolic, "no graph had a symbolic batch"


@pytest.mark.parametrize("mode", ["automatic", "mark_dynamic"])
def test_calls_with_a_query_each_share_a_plan_under_a_symbolic_batch(planned_backend, mode):
    """A step whose layers each take their own query (as a model's do; q_nope / q_pe slices of one [T, H, L+R]
    tensor, as the benchmarks pass them), compiled with a symbolic batch: every layer's query has its own symbol
    for T, which only each call's lowering equates with B. The calls still count as sharing one plan (the
    context the selection reads: a whole step, not a one-call graph; found on an H100, where such steps
    were selected as one-call graphs), and the graph plans once."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    n, width = 3, SMALL["kv_lora_rank"]

    def step(qs, cache, block_table, seq_lens, kv_scale):
        return [torch.ops.mla.paged_decode(q[..., :width], q[..., width:], cache, block_table, seq_lens, 0.07, kv_scale)
                for q in qs]

    compiled = torch.compile(step, fullgraph=True)
    codes = []

    def run_all():
        # The generated code kept as run_and_get_code does, without its reset (which would forget the first batch
        # size, so the second would compile static again).
        with fresh_cache(), mla_inductor.prefer_backends("planned_test"), \
                mock.patch.object(GraphLowering, "save_output_code", codes.append):
            for i, B in enumerate((4, 8)):
                x = make_decode_inputs(seq_lens=[(7 * b + i) % 11 + 1 for b in range(B)], max_pages=3, seed=i, **SMALL)
                q = torch.cat([x.q_nope, x.q_pe], -1)
                qs = [q] + [torch.randn_like(q) for _ in range(n - 1)]
                if mode == "mark_dynamic":
                    for t in (*qs, x.kv_cache, x.block_table, x.seq_lens):
                        torch._dynamo.mark_dynamic(t, 0)
                outs = compiled(qs, x.kv_cache, x.block_table, x.seq_lens, x.kv_scale)
                for out, q in zip(outs, qs):
                    want = mla_inductor.paged_decode_reference(q[..., :width], q[..., width:], x.kv_cache, x.block_table,
                                                               x.seq_lens, 0.07, x.kv_scale)[0]
                    assert relative_error(out, want) < 1e-2

    recorded = _decisions_of(run_all)
    symbolic = [d for d in recorded if any(note.startswith("batch: symbolic") for note in d.notes)]
    assert symbolic, "no graph had a symbolic batch"
    assert all(d.context == CallContext(n, captured=False) for d in recorded), [d.context for d in recorded]
    assert all(code.count("mla_test.plan.default(") == 1 for code in codes) and codes


def test_an_unbacked_batch_takes_the_largest_class(planned_backend):
    """``mark_unbacked`` batch dims (no value to guard on): the class above every batch limit, B=1 included
    in the same graph; the step says T == B (one new token per sequence), so Q is known without a guard."""
    torch._dynamo.reset()
    kw = SMALL

    def step(q_nope, q_pe, block_table, seq_lens, kv_scale, kv_cache):
        torch._check(q_nope.shape[0] == block_table.shape[0])
        return layers(1)(q_nope, q_pe, block_table, seq_lens, kv_scale, kv_cache)

    compiled = torch.compile(step, fullgraph=True)
    from torch._inductor.utils import fresh_cache

    def run_all():
        with fresh_cache(), mla_inductor.prefer_backends("planned_test"):
            for i, B in enumerate((1, 3, 6)):
                x = make_decode_inputs(seq_lens=[(7 * b + i) % 11 + 1 for b in range(B)], max_pages=3, seed=i, **kw)
                args = (x.q_nope, x.q_pe, x.block_table, x.seq_lens, x.kv_scale, x.kv_cache)
                for t in args[:4]:
                    torch._dynamo.decorators.mark_unbacked(t, 0)
                assert relative_error(compiled(*args), step(*args)) < 1e-2

    (decision,) = _decisions_of(run_all)
    assert decision.problem.batch is None and decision.problem.q_per_seq == 1
    assert any(note.startswith("batch: unbacked") for note in decision.notes), decision.notes
    problem = on_h100(decision.problem)
    assert select_backend(problem, SM90, available=EVERYTHING, preference=()).backend == "flashmla"


# ----------------------------------------------------------------------------- one plan per step


def test_one_plan_per_step_across_separately_compiled_regions(planned_backend):
    """Three layers compiled one by one (regional compilation), then run eagerly: the first call of a step
    plans, the others reuse its plan; a new step (seq_lens written) plans again, once."""
    x = make_decode_inputs(seq_lens=[5, 17, 9], kv_lora_rank=32, rope_dim=16, page_size=4, num_heads=3,
                           q_dtype=torch.float32, fmt="fp32")
    caches = [x.kv_cache.clone() for _ in range(3)]

    def layer(h, q_pe, kv_cache, block_table, seq_lens, kv_scale):
        return torch.ops.mla.paged_decode(h, q_pe, kv_cache, block_table, seq_lens, 0.125, kv_scale)

    torch._dynamo.reset()
    with mla_inductor.prefer_backends("planned_test"):
        regions = [torch.compile(layer, fullgraph=True) for _ in caches]  # one compiled region per layer

        def step(fns):
            h = x.q_nope
            for fn, cache in zip(fns, caches):
                h = fn(h, x.q_pe, cache, x.block_table, x.seq_lens, x.kv_scale)
            return h

        planned_backend.PLANS_MADE.clear()
        for new_lens in ([5, 17, 9], [6, 18, 10], [7, 19, 11]):
            x.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))  # the next step's lengths
            before = len(planned_backend.PLANS_MADE)
            got = step(regions)  # the run op checks it got the plan of these lengths
            assert len(planned_backend.PLANS_MADE) == before + 1
            assert relative_error(got, step([layer] * 3)) < 1e-5
        before = len(planned_backend.PLANS_MADE)
        step([layer] * 3)  # eager: the lengths did not change, the last plan still holds
        assert len(planned_backend.PLANS_MADE) == before


# ----------------------------------------------------------------------------- selection by cost in context


def test_a_one_call_graph_at_batch_one_goes_to_triton(fake_sm90):
    """B=1 bf16 on an H100: in a step of many layers FA3 wins (its host plan is shared by all of them); a graph
    of one call goes to the one-call row, our Triton kernel (two launches, no plan;
    docs/results.md#program-shapes)."""
    _, (many,) = lowered(4, "bf16", B=1)
    assert many.backend == "flashinfer_fa3" and many.context == CallContext(4, False)
    for captured in (False, True):
        _, (one,) = lowered(1, "bf16", B=1, captured=captured)
        assert one.backend == "triton" and one.context == CallContext(1, captured) and one.reasons == ()


@pytest.mark.parametrize("batch,heads,uncaptured", [(8, 128, "flashinfer_fa3"), (32, 16, "flashinfer_fa3"),
                                                    (32, 128, "flashmla"), (64, 16, "flashmla")])
def test_a_whole_step_without_cuda_graphs_takes_the_host_cheap_backend(fake_sm90, batch, heads, uncaptured):
    """A step of many layers compiled without CUDA graphs is bound by host work at small B: FA3 up to B=16, and
    B=32 at H <= 16 (docs/results.md#program-shapes); the same step captured keeps FlashMLA."""
    _, (plain,) = lowered(4, "bf16", B=batch, heads=heads)
    assert plain.context == CallContext(4, False) and plain.backend == uncaptured
    _, (captured,) = lowered(4, "bf16", B=batch, heads=heads, captured=True)
    assert captured.context == CallContext(4, True) and captured.backend == "flashmla"


def test_a_step_captured_by_its_caller_is_chosen_for_as_captured(fake_sm90):
    """``hf.CapturedDecodeStep`` captures a step of separately compiled layers in one CUDA graph of its own, which
    Inductor does not know of: graphs compiled inside ``compiling_for_capture()`` are chosen for as captured ones
    (FA3's host plan cannot be replayed), and Inductor's FX-graph cache keys them apart from the others."""
    from mla_inductor.lowering import MLALoweringPass

    with compiling_for_capture():
        _, (inside,) = lowered(3, "bf16", B=4, heads=128)
        key_inside = MLALoweringPass().uuid()
    _, (outside,) = lowered(3, "bf16", B=4, heads=128)
    assert inside.context == CallContext(3, True) and inside.backend == "flashmla"
    assert outside.context == CallContext(3, False) and outside.backend == "flashinfer_fa3"
    assert key_inside != MLALoweringPass().uuid()


def test_a_one_call_graph_names_the_plan_cost(fake_sm90, monkeypatch):
    """Without FlashMLA, FA3 leads the B=2 H=128 row; a graph of one call cannot share its host plan, so Triton,
    which needs no plan, goes first, and the decision says why."""
    from mla_inductor import backends

    monkeypatch.setattr(backends, "availability", lambda: {**EVERYTHING, "flashmla": "not installed"})
    _, (many,) = lowered(4, "bf16", B=2, heads=128)
    assert many.backend == "flashinfer_fa3"
    # (Uncaptured one-call graphs of up to 32 sequences have a row of their own with Triton first: B=33 here.)
    for captured, B in ((False, 33), (True, 2)):
        _, (one,) = lowered(1, "bf16", B=B, heads=128, captured=captured)
        assert one.backend == "triton" and one.context == CallContext(1, captured)
        (why,) = [r for r in one.reasons if r.startswith("flashinfer_fa3:")]
        assert "plan cost not amortized" in why and "host plan" in why and "1 call" in why
        assert ("splits the CUDA graph" in why) == captured


def test_a_user_preference_is_not_reordered(fake_sm90):
    with mla_inductor.prefer_backends("flashinfer_fa3", "flashmla"):
        _, (one,) = lowered(1, "bf16", B=1)
    assert one.backend == "flashinfer_fa3"


# ----------------------------------------------------------------------------- little host work per eager call


def test_an_eager_call_validates_and_selects_once_per_signature(monkeypatch):
    """The shape checks and the selection run for the first call of a signature; later calls look them up.
    A call with another signature is checked afresh (bad input still fails with the contract's message)."""
    import mla_inductor.ops as ops
    import mla_inductor.selection as selection

    counts = {"check": 0, "select": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ops, "check_decode_args", counted("check", ops.check_decode_args))
    monkeypatch.setattr(selection, "select_backend", counted("select", selection.select_backend))
    monkeypatch.setattr(ops, "_EAGER_CALLS", Memo())
    x = make_decode_inputs(seq_lens=[5, 17, 9], **{k: v for k, v in SMALL.items()})
    want = mla_inductor.paged_decode_reference(*x.args())[0]
    for _ in range(3):
        assert relative_error(torch.ops.mla.paged_decode(*x.args()), want) < 1e-2
    assert counts == {"check": 1, "select": 1}
    args = list(x.args())
    args[1] = args[1].float()  # q_pe's dtype no longer q_nope's
    with pytest.raises(TypeError, match="mla.paged_decode: q_pe must have q_nope's dtype"):
        torch.ops.mla.paged_decode(*args)
    assert counts["check"] == 2


# ----------------------------------------------------------------------------- one-graph CUDA graphs

def _graph_writing_inputs(decode: bool = True, lengths_written: bool = True, cache_written: bool = True,
                          device: str = "cuda"):
    """A post-grad graph as the pass sees it: placeholders for a cache and lengths (fake tensors on ``device``),
    optionally a decode call, a functionalized ``mla.cache_append`` whose result is copied back into the cache,
    and an increment of the lengths copied back into them."""
    import operator

    with FakeTensorMode():
        cache_val = torch.empty(4, 64, 576, dtype=torch.bfloat16, device=device)
        lens_val = torch.empty(2, dtype=torch.int32, device=device)
    g = torch.fx.Graph()
    cache, lens = g.placeholder("kv_cache"), g.placeholder("seq_lens")
    cache.meta["val"], lens.meta["val"] = cache_val, lens_val
    if decode:
        g.call_function(torch.ops.mla.paged_decode.default, (cache, cache, cache, lens, lens, 0.1, lens, None))
    if cache_written:
        written = g.call_function(torch.ops.higher_order.auto_functionalized_v2,
                                  (torch.ops.mla.cache_append.default,))
        g.call_function(torch.ops.aten.copy_.default, (cache, g.call_function(operator.getitem, (written, 1))))
    if lengths_written:
        g.call_function(torch.ops.aten.copy_.default, (lens, g.call_function(torch.ops.aten.add.Tensor, (lens, 1))))
    g.output(None)
    return g


def test_one_graph_cudagraphs_refuse_a_graph_that_writes_its_lengths():
    """Inductor's older CUDA-graph path (``triton.cudagraph_trees=False``) runs a graph's first call twice (warm-up,
    then the first replay): a graph of ours that increments CUDA lengths in place would decode one position off
    (seen on an H100). The pass refuses it with what to do; our cache writer's writes (the same rows to the same
    slots the second time), CPU graphs, graphs without our ops, CUDA-graph trees and no CUDA graphs pass."""
    from mla_inductor.lowering.graph_pass import refuse_one_graph_cudagraphs_writing_inputs as check

    one_graph = {"triton.cudagraphs": True, "triton.cudagraph_trees": False}
    with torch._inductor.config.patch(one_graph):
        with pytest.raises(RuntimeError, match=r"1 of its CUDA inputs in place.*seq_lens.*cudagraph_trees=False"
                                               r".*reduce-overhead"):
            check(_graph_writing_inputs())
        with pytest.raises(RuntimeError, match="seq_lens"):  # the cache writer's graph alone, lengths written too
            check(_graph_writing_inputs(decode=False))
        check(_graph_writing_inputs(lengths_written=False))  # only our cache writer writes
        check(_graph_writing_inputs(device="cpu"))  # never captured
        check(_graph_writing_inputs(decode=False, cache_written=False))  # not a graph of ours
    with torch._inductor.config.patch({"triton.cudagraphs": True, "triton.cudagraph_trees": True}):
        check(_graph_writing_inputs())
    with torch._inductor.config.patch({"triton.cudagraphs": False, "triton.cudagraph_trees": False}):
        check(_graph_writing_inputs())
