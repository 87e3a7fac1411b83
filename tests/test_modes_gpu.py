"""Every backend available here in every way a user runs a decode step, on the GPU, under
``torch.cuda.set_sync_debug_mode("error")``: no device->host sync anywhere in a step.

A step of two layers: ``PagedLatentCache.reserve`` (the step's bookkeeping, host copy of the lengths
included), then per layer ``mla.cache_append`` and ``mla.paged_decode`` chained through the layers. Modes:
eager, the whole step compiled (with and without CUDA graphs), and each layer compiled on its own (regional
compilation, with and without CUDA graphs; ``torch.compiler.cudagraph_mark_step_begin()`` per step). Each
backend is forced with ``prefer_backends``; one that cannot run the call here is skipped with its reason.
The steps are compiled and warmed up (CUDA graphs recorded) first, then two steps run under the sync check,
and the last one's output is checked against the reference on the cache the step left. Cache memory no
sequence holds has large random values (not NaN: the reference reads it, masked), so a kernel that reads
outside the sequences shows.

Known sync, kept visible as a strict xfail: FlashInfer's wrapper on sparse (top-k) calls plans from each
row's count of valid slots, which only the device knows (dense calls read the host copy of the lengths).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_inductor
from mla_inductor.backends import availability, device_capability, get_backend, registered_backends
from mla_inductor.cache import cache_format, encode_tokens
from mla_inductor.contract import DecodeProblem
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

LAYERS, CONTEXT, TOPK, SCALE = 2, [70, 1, 200, 129], 64, 576 ** -0.5
CASES = {  # name -> (cache format, sparse, heads)
    "bf16": ("bf16", False, 16),
    "fp8_e4m3": ("fp8_e4m3", False, 16),
    "bf16-sparse": ("bf16", True, 64),
    "fp8_ds_mla-sparse": ("fp8_ds_mla", True, 64),
}
MODES = ("eager", "compiled", "cudagraphs", "per_layer", "per_layer_cudagraphs")
# The reference's compiled code is generated Triton (slow to compile): one case is enough to show it syncs nowhere.
REFERENCE_CASES = ("bf16",)
# Errors allowed for a 2-layer chain: the first layer's output is the second's query.
TOL = {"bf16": 2 * TOLERANCE[torch.bfloat16], "fp8_e4m3": 5e-2, "fp8_ds_mla": 3e-2}  # FlashMLA fp8: q in e4m3 too


def _problem(fmt, sparse, heads) -> DecodeProblem:
    return DecodeProblem(device_type="cuda", cache_format=fmt, q_dtype=torch.bfloat16, num_heads=heads,
                         kv_lora_rank=512, rope_dim=64, page_size=64, sparse=sparse, topk=TOPK if sparse else None,
                         q_per_seq=1, batch=len(CONTEXT))


def _skip_unless_runs(backend: str, case: str):
    if backend == "reference" and case not in REFERENCE_CASES:
        pytest.skip("the reference runs the bf16 case only (its compiled code takes long to generate)")
    _skip_unless_supported(backend, _problem(*CASES[case]), case)


def _skip_unless_supported(backend: str, problem: DecodeProblem, what: str) -> None:
    why = availability().get(backend)
    if why is None:
        why = get_backend(backend).supports(problem, device_capability(torch.device("cuda")))
    if why is not None:
        pytest.skip(f"{backend} cannot run {what} here: {why}")


def _garbage_fill(kv: torch.Tensor, kv_scale: torch.Tensor) -> None:
    """Large random values in every row (keys 30x the real ones: any of them read dominates the softmax)."""
    rows = torch.randn(*kv.shape[:2], 576, device=kv.device) * 30
    kv.copy_(encode_tokens(rows, cache_format(kv), kv_scale))


def _cache(fmt: str) -> mla_inductor.PagedLatentCache:
    kv_scale = 0.05 if fmt == "fp8_e4m3" else 1.0
    cache = mla_inductor.PagedLatentCache.allocate(num_layers=LAYERS, batch_size=len(CONTEXT),
                                                   max_seq_len=max(CONTEXT) + 16, fmt=fmt, kv_scale=kv_scale,
                                                   num_pages=24, device="cuda")
    for kv in cache.kv_caches:
        _garbage_fill(kv, cache.kv_scale)
    slots = cache.reserve(CONTEXT)
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in range(LAYERS):
        n = slots.shape[0]
        cache.append(layer, torch.randn(n, 512, device="cuda", generator=g).bfloat16(),
                     torch.randn(n, 64, device="cuda", generator=g).bfloat16(), slots)
    return cache


def _sparse_indices(cache) -> torch.Tensor:
    """TOPK slots per row among its sequence's cached tokens (-1 padding where there are fewer)."""
    g = torch.Generator().manual_seed(1)
    table, lens = cache.block_table.cpu(), cache.seq_lens.cpu()
    idx = torch.full((len(CONTEXT), TOPK), -1, dtype=torch.int32)
    for b in range(len(CONTEXT)):
        pos = torch.randperm(int(lens[b]), generator=g)[:TOPK]
        idx[b, :len(pos)] = (table[b, pos // 64].long() * 64 + pos % 64).int()
    return idx.cuda()


def layer_step(kv_cache, kv_c, k_pe, slots, h, q_pe, block_table, seq_lens, kv_scale, sparse_indices):
    torch.ops.mla.cache_append(kv_cache, kv_c, k_pe, slots, kv_scale)
    return torch.ops.mla.paged_decode(h, q_pe, kv_cache, block_table, seq_lens, SCALE, kv_scale, sparse_indices)


def whole_step(caches, kv_cs, k_pes, slots, q_nope, q_pe, block_table, seq_lens, kv_scale, sparse_indices,
               layer=layer_step):
    h = q_nope
    for kv_cache, kv_c, k_pe in zip(caches, kv_cs, k_pes):
        h = layer(kv_cache, kv_c, k_pe, slots, h, q_pe, block_table, seq_lens, kv_scale, sparse_indices)
    return h


def _stepper(mode: str):
    """A function running one decode step's layers in ``mode``."""
    cudagraphs = "reduce-overhead" if mode.endswith("cudagraphs") else None
    if mode == "eager":
        return whole_step
    if mode.startswith("per_layer"):
        layer = torch.compile(layer_step, fullgraph=True, mode=cudagraphs)

        def per_layer(*args):
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            return whole_step(*args, layer=layer)

        return per_layer
    return torch.compile(whole_step, fullgraph=True, mode=cudagraphs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", sorted(registered_backends()))
def test_a_decode_step_never_waits_for_the_device(backend, case, mode, request):
    _skip_unless_runs(backend, case)
    fmt, sparse, heads = CASES[case]
    if sparse and getattr(get_backend(backend), "plans_on_host", False):
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=RuntimeError,
            reason="FlashInfer plans sparse calls from each row's count of valid slots, known on the device only"))
    _check_steps_never_wait(backend, fmt, sparse, heads, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_decode_step_on_an_e4m3_query_never_waits_for_the_device(mode):
    """FlashMLA-fp8 on calls that allowed an e4m3 query (q quantized in the call eager, in the graph compiled)."""
    _skip_unless_supported("flashmla", dataclasses.replace(_problem("fp8_e4m3", False, 64), fp8_query=True),
                           "an e4m3 query")
    with mla_inductor.allow_fp8_query():
        _check_steps_never_wait("flashmla", "fp8_e4m3", False, 64, mode)


def _check_steps_never_wait(backend: str, fmt: str, sparse: bool, heads: int, mode: str) -> None:
    """Compile and warm up the step in ``mode`` on ``backend``, run two steps under the sync check, check the last
    one against the reference."""
    torch.compiler.reset()
    cache = _cache(fmt)
    sparse_indices = _sparse_indices(cache) if sparse else None
    B = len(CONTEXT)
    g = torch.Generator(device="cuda").manual_seed(2)
    run = _stepper(mode)

    def step():
        slots = cache.reserve(1)
        new = [torch.randn(B, 512, device="cuda", generator=g).bfloat16() for _ in range(LAYERS)]
        rope = [torch.randn(B, 64, device="cuda", generator=g).bfloat16() for _ in range(LAYERS)]
        q_nope = (torch.randn(B, heads, 512, device="cuda", generator=g) * 0.5).bfloat16()
        q_pe = (torch.randn(B, heads, 64, device="cuda", generator=g) * 0.5).bfloat16()
        out = run(cache.kv_caches, new, rope, slots, q_nope, q_pe, cache.block_table, cache.seq_lens,
                  cache.kv_scale, sparse_indices)
        return out.clone(), q_nope, q_pe

    with mla_inductor.prefer_backends(backend):
        for _ in range(3):  # compile, warm up, record CUDA graphs: allowed to sync
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                out, q_nope, q_pe = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert cache.host_seq_lens.tolist() == cache.seq_lens.tolist() == [n + 5 for n in CONTEXT]
    h = q_nope
    for kv in cache.kv_caches:
        h = paged_decode_reference(h, q_pe, kv, cache.block_table, cache.seq_lens, SCALE, cache.kv_scale,
                                   sparse_indices)[0]
    err = relative_error(out, h)
    assert err <= TOL[fmt], f"{backend} {fmt} sparse={sparse} {mode}: error {err:.2e} vs the reference"


@pytest.mark.parametrize("case", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", sorted(registered_backends()))
def test_eager_calls_on_a_second_gpu_run_there(backend, case):
    """Eager calls on cuda:1 while cuda:0 is current (no device guard of the caller's) write and read cuda:1's
    cache: the op makes the tensors' device current, as the compiled code does."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _skip_unless_runs(backend, case)
    if backend == "reference":
        pytest.skip("the reference runs torch ops, which follow their tensors' device")
    fmt, _, heads = CASES[case]
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    kv_scale = 0.05 if fmt == "fp8_e4m3" else 1.0
    cache = mla_inductor.PagedLatentCache.allocate(num_layers=1, batch_size=len(CONTEXT), max_seq_len=max(CONTEXT) + 16,
                                                   fmt=fmt, kv_scale=kv_scale, num_pages=24, device=dev)
    _garbage_fill(cache.kv_caches[0], cache.kv_scale)
    g = torch.Generator(device=dev).manual_seed(3)
    slots = cache.reserve(CONTEXT)
    n = slots.shape[0]
    q_nope = (torch.randn(len(CONTEXT), heads, 512, device=dev, generator=g) * 0.5).bfloat16()
    q_pe = (torch.randn(len(CONTEXT), heads, 64, device=dev, generator=g) * 0.5).bfloat16()
    with mla_inductor.prefer_backends(backend):
        torch.ops.mla.cache_append(cache.kv_caches[0], torch.randn(n, 512, device=dev, generator=g).bfloat16(),
                                   torch.randn(n, 64, device=dev, generator=g).bfloat16(), slots, cache.kv_scale)
        out = torch.ops.mla.paged_decode(q_nope, q_pe, cache.kv_caches[0], cache.block_table, cache.seq_lens, SCALE,
                                         cache.kv_scale, None)
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0
    want = paged_decode_reference(q_nope, q_pe, cache.kv_caches[0], cache.block_table, cache.seq_lens, SCALE,
                                  cache.kv_scale, None)[0]
    err = relative_error(out, want)
    assert out.device == dev and err <= TOL[fmt], f"{backend} {case} on cuda:1: error {err:.2e} vs the reference"


def test_gpu_one_graph_cudagraphs_never_write_lengths_twice():
    """torch.compile with ``triton.cudagraph_trees=False``: Inductor's older CUDA-graph path runs a graph's first
    call twice (warm-up, then the first replay), so a graph incrementing static lengths in place would advance them
    twice. The pass refuses such a graph of ours with what to do instead; where torch itself skips
    CUDA graphs for it, the lengths advance once per call."""
    from mla_inductor import _compat
    from mla_inductor.testing import make_decode_inputs

    torch.compiler.reset()
    x = make_decode_inputs(seq_lens=[100, 37], num_heads=16, device="cuda")
    args = list(x.args())
    lens = args[4]
    _compat.mark_static_address(lens)

    def step(q_nope, q_pe, cache, table, lens, scale, kv_scale, sparse):
        out = torch.ops.mla.paged_decode(q_nope, q_pe, cache, table, lens, scale, kv_scale, sparse)
        lens.add_(1)
        return out

    compiled = torch.compile(step, fullgraph=True,
                             options={"triton.cudagraphs": True, "triton.cudagraph_trees": False})
    before = lens.clone()
    try:
        compiled(*args)
    except Exception as e:  # noqa: BLE001 - Inductor wraps the pass's error
        assert "cudagraph_trees=False" in str(e) and "reduce-overhead" in str(e), str(e)[:500]
        assert torch.equal(lens, before), "refused before anything ran"
        return
    torch.cuda.synchronize()
    assert torch.equal(lens, before + 1), f"lengths advanced by {(lens - before).tolist()} in one call"
