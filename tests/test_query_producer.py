"""benchmarks/query_producer.py and bench_pass --q-producer, on CPU: both sides make the same q, and in
our compiled step the pass's quantization of q fuses into q's producer.

bench_pass --q-producer computes every call's q in the timed step, on both sides: ours in the compiled
step (the pass writes q's quantization as aten ops, which Inductor should fuse into the producer), the
peers with the same producer and their own quantization, compiled by Inductor into the buffers their
kernel reads. Here: the rope against the de-interleaved rotate_half formulation, the peer-side writers
against our step's q (bit for bit in e4m3), and our step compiled on CPU with a test backend whose kernel
takes q in e4m3 (tests/quantized_query_backend.py): the e4m3 query its op receives, the results, and the
generated code (one kernel per layer making the e4m3 query from the producer's inputs, no bf16 q in
memory). The GPU timing itself is bench_pass's.
"""

from __future__ import annotations

import re

import pytest
import torch

import mla_inductor
from mla_inductor.backends._common import quantize_query_reference
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import relative_error
from benchmark_modules import BENCHMARKS, load_benchmark
from small_problems import small_inputs





qp = load_benchmark("query_producer")
LAYERS = 3


def _case(seed: int = 1):
    """A small decode problem (H=3, L=32, R=16) and three layers' producer inputs; q_scale calibrated on
    the first layer's q with 10% headroom."""
    x = small_inputs(seq_lens=[5, 9, 17], seed=seed)
    T, H, L = x.q_nope.shape
    first = qp.ProducedQuery.random(T, H, L, x.q_pe.shape[-1], x.seq_lens.long() - 1,
                                    generator=torch.Generator().manual_seed(seed))
    layers = first.layers(LAYERS)
    q_scale = (first.query().float().abs().amax() * 1.1 / 448).reshape(1)
    return x, layers, q_scale


def _rope_rotate_half(x, positions, theta=qp.ROPE_THETA):
    """DeepSeek's rope as transformers long wrote it: de-interleave, then q * cos + rotate_half(q) * sin
    with cos / sin = cat(freqs, freqs)."""
    R = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    x = x.float().unflatten(-1, (R // 2, 2)).transpose(-1, -2).flatten(-2)
    rotated = torch.cat([-x[..., R // 2:], x[..., :R // 2]], -1)
    return x * emb.cos() + rotated * emb.sin()


def test_rope_is_deepseeks_interleaved_rope():
    x = torch.randn(4, 3, 16)
    positions = torch.tensor([0, 7, 100, 4095])
    cos, sin = qp.rope_tables(positions, 16)
    torch.testing.assert_close(qp.rope_interleaved(x, cos, sin), _rope_rotate_half(x, positions), rtol=1e-5,
                               atol=1e-5)
    halves = torch.cat([x[:1, ..., 0::2], x[:1, ..., 1::2]], -1)  # position 0: de-interleaved, not rotated
    assert torch.equal(qp.rope_interleaved(x[:1], cos[:1], sin[:1]), halves)


def test_layers_have_their_own_inputs_and_tables_of_the_same_positions():
    _, layers, _ = _case()
    first, second = layers[0], layers[1]
    assert not torch.equal(first.q_raw, second.q_raw) and not torch.equal(first.w_nope, second.w_nope)
    assert torch.equal(first.cos, second.cos) and first.cos.data_ptr() != second.cos.data_ptr()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_peer_writers_write_the_query_our_step_makes(compiled):
    """The peers' buffers hold our step's q: the same bf16 q (joined or split), and in e4m3 the bits of the
    pass's quantization (``quantize_query_reference``, what the op's graph computes) for the same scale."""
    x, layers, q_scale = _case()
    L = x.q_nope.shape[-1]
    for made in layers[:2]:
        q = made.query()
        ours_split = torch.cat([made.q_raw[..., :L] * made.w_nope, qp.rope_interleaved(made.q_raw[..., L:], made.cos,
                                                                                      made.sin)], -1)
        assert torch.equal(q, ours_split)  # rope and rope-joined hand the op the same values
        for entries in qp.WRITERS:
            write = qp.query_writer(entries)
            if compiled:
                torch._dynamo.reset()
                write = torch.compile(write, fullgraph=True, dynamic=False)
            buffers = qp.query_buffers(entries, q, L)
            for b in buffers:
                b.view(torch.uint8).fill_(0xFF)  # NaN in bf16 and in e4m3fn: what the writer leaves shows
            write(made.q_raw, made.w_nope, made.cos, made.sin, q_scale, *buffers)
            if entries == ("q_fp8",):
                want = quantize_query_reference(q, q_scale)[0]
                assert torch.equal(buffers[0].view(torch.uint8), want.view(torch.uint8)), entries
            else:
                got = torch.cat(buffers, -1)
                assert torch.equal(got, q), (entries, (got.float() - q.float()).abs().max())


def test_query_writer_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="query_writer: entries must be one of"):
        qp.query_writer(("q", "q_pe"))


@pytest.fixture
def quantized_query_backend(monkeypatch):
    """The test backend taking q in e4m3, preferred; value checks off, as on a GPU without
    MLA_INDUCTOR_DEBUG (on CPU the pass puts ``mla.check_decode_values`` before each call, which reads
    the bf16 q_nope and so keeps it in memory)."""
    import quantized_query_backend as qb
    from mla_inductor import backends
    from mla_inductor.lowering import graph_pass

    backends.register_backend("quantized_query_test", "quantized_query_backend")
    monkeypatch.setattr(graph_pass, "wants_value_checks", lambda *args: False)
    qb.QUERIES_SEEN.clear()
    with mla_inductor.prefer_backends("quantized_query_test"):
        yield qb
    backends.unregister_backend("quantized_query_test")


def _compile_our_step(x, layers, q_scale, joined: bool):
    from torch._inductor.utils import fresh_cache, run_and_get_code

    step = qp.produced_query_step(x.softmax_scale, joined)
    args = qp.step_arguments(layers, [x.kv_cache], x.block_table, x.seq_lens, x.kv_scale, None, q_scale)
    torch._dynamo.reset()
    # Inductor lowers a concatenation feeding pointwise ops into those ops on GPUs, and on CPU into a
    # buffer of its own (ConcatKernel); force_pointwise_cat makes the CPU code what a GPU gets.
    with fresh_cache(), torch._inductor.config.patch(force_pointwise_cat=True):
        outs, codes = run_and_get_code(torch.compile(step, fullgraph=True), *args)
    body = codes[0][codes[0].index("def call("):]
    return outs, body


def assert_same_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal e4m3 queries, but for a few elements one e4m3 step apart: where Inductor fuses the producer
    into the quantization it may skip rounding the producer's bf16 intermediates (the product, the rope)
    and quantize their fp32 values, which lands on the other side of an e4m3 rounding boundary now and then
    (measured here: 5 to 7 of 432 elements for --q-producer rope; none with rope-joined)."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert differ.float().mean() <= 0.05, f"{int(differ.sum())} of {differ.numel()} e4m3 values differ"
    a, b = got.float(), want.float()
    assert ((a - b).abs() <= b.abs() / 8 + 2.0 ** -9).all(), (a - b).abs().max()  # one step: 3 mantissa bits


@pytest.mark.parametrize("joined", [False, True], ids=["rope", "rope-joined"])
def test_our_step_quantizes_q_as_the_peers_do(quantized_query_backend, joined):
    """The e4m3 query our compiled step hands the kernel is the one the fp8 peers get (the peer writer's
    values, each layer), and each layer's result is the reference on it."""
    x, layers, q_scale = _case()
    outs, _ = _compile_our_step(x, layers, q_scale, joined)
    seen = quantized_query_backend.QUERIES_SEEN
    assert len(seen) == LAYERS
    for made, q8, out in zip(layers, seen, outs):
        peer_q8 = qp.quantize_like_peer(made.query(), q_scale)
        assert_same_e4m3(q8, peer_q8)
        qd = (peer_q8.float() * q_scale).to(torch.bfloat16)
        L = x.q_nope.shape[-1]
        want, _ = paged_decode_reference(qd[..., :L].contiguous(), qd[..., L:].contiguous(), *x.args()[2:])
        assert relative_error(out, want) < 1e-2
        assert relative_error(q8.float() * q_scale, made.query()) > 0  # really quantized


KERNEL = re.compile(r"^\s+(cpp_fused\w*)\((.*)\)$", re.M)
DECODE = re.compile(r"torch\.ops\.mla_test\.decode_quantized_query\.default\((\w+),")


@pytest.mark.parametrize("joined", [False, True], ids=["rope", "rope-joined"])
def test_our_step_fuses_the_quantization_into_the_producer(quantized_query_backend, joined):
    """``--q-producer rope`` (q_nope and q_pe as two tensors, as mla_inductor.hf passes them) and
    ``rope-joined`` (the two halves of one q, as vLLM passes them: the pass quantizes that q whole): per layer
    one kernel, reading the producer's inputs and writing only the e4m3 query the op reads; no bf16 q is
    allocated, and no other kernel runs."""
    x, layers, q_scale = _case()
    T, H, L = x.q_nope.shape
    width = L + x.q_pe.shape[-1]
    _, body = _compile_our_step(x, layers, q_scale, joined=joined)
    kernels, decodes = KERNEL.findall(body), DECODE.findall(body)
    assert len(kernels) == LAYERS and len(decodes) == LAYERS, body
    allocated = re.findall(r"empty_strided_cpu\(\((\d+), (\d+), (\d+)\), \([^)]*\), torch\.(\w+)\)", body)
    full_q = {dtype for *shape, dtype in allocated if tuple(map(int, shape)) == (T, H, width)}
    assert full_q == {"float8_e4m3fn"}, allocated  # q exists only in e4m3 (buffers are reused between layers)
    for (_, kernel_args), q8 in zip(kernels, decodes):
        assert q8 in kernel_args.split(", "), (q8, kernel_args)  # the producer's kernel writes what the op reads


@pytest.mark.parametrize("entries", list(qp.WRITERS), ids=lambda e: "+".join(e))
def test_bench_pass_peer_writes_each_calls_query_before_its_kernel(monkeypatch, entries):
    """bench_pass's produced_peer (CPU, compiled writer): the kernel reads the buffers of its layout
    (``peers.QUERY_ENTRIES``), and every call rewrites them from the producer inputs (new values reach
    the kernel); the case's "q" is the bf16 q the peer's reference is computed on."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_pass = load_benchmark("bench_pass")
    x, layers, q_scale = _case()
    L = x.q_nope.shape[-1]
    made = layers[0]
    seen = {}

    def fake_peer(c):
        seen.update(c)
        return lambda: [c[e].clone() for e in entries]

    def expected():
        q = made.query()
        if entries == ("q_fp8",):
            return [qp.quantize_like_peer(q, q_scale)]
        return [q] if entries == ("q",) else [q[..., :L], q[..., L:]]

    def same(got, want):
        return all(torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8)) for g, w in zip(got, want))

    torch._dynamo.reset()
    run = bench_pass.produced_peer(fake_peer, entries)({"produced": made, "q_scale": q_scale})
    assert seen["q_scale"] is q_scale and (entries == ("q",) or torch.equal(seen["q"], made.query()))
    assert same(run(), expected())
    made.q_raw.copy_(layers[1].q_raw)  # new producer inputs: the next call must see them
    assert same(run(), expected())


def test_every_dense_peer_names_a_query_layout_the_writers_know(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    peers = load_benchmark("peers")
    dense = set(peers.PEERS) | set(peers.DENSE_DS_PEERS)
    assert dense <= set(peers.QUERY_ENTRIES), dense - set(peers.QUERY_ENTRIES)
    assert set(peers.QUERY_ENTRIES.values()) <= set(qp.WRITERS)


@pytest.mark.parametrize("halves", [
    ((-1, 0, 8), (-1, 8, 10)),                 # q[..., 0:8], q[..., 8:10]
    ((-1, None, 8), (-1, 8, None)),            # q[..., :8], q[..., 8:] as traced with the schema's None ends
    ((-1, 0, 8), (-1, 8, 2 ** 63 - 1)),        # the end Dynamo writes for "to the end"
    ((2, 0, 8), (-1, -2, None)),               # the last dim by its number, the rope half from the end
    ((-1,), (-1, 8, 10)),                      # q[..., :] is not a half: not joined
    ((-1, 0, 7), (-1, 8, 10)),                 # a gap: not joined
], ids=["ints", "none-ends", "maxsize-end", "dim-number-negative-start", "whole", "gap"])
def test_joined_query_reads_every_way_a_slice_is_written(halves):
    """The pass quantizes q whole where q_nope / q_pe are its two halves; a slice written with the schema's
    defaults (None ends, the max-int end, a negative start) is read, never a TypeError."""
    from mla_inductor.lowering.graph_pass import _joined_query

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    q.meta["val"] = torch.empty(2, 4, 10, device="meta")
    nodes = []
    for args in halves:
        node = graph.call_function(torch.ops.aten.slice.Tensor, (q, *args))
        full = dict(zip(("dim", "start", "end"), args))
        start, end = full.get("start") or 0, full.get("end")
        end = 10 if end is None or end > 10 else end
        start = start + 10 if start < 0 else start
        node.meta["val"] = torch.empty(2, 4, max(end - start, 0), device="meta")
        nodes.append(node)
    joined = _joined_query(*nodes)
    expect = halves[0] != (-1,) and halves[0][-1] == 8
    assert (joined is q) == expect, (halves, joined)
