"""Decode context parallelism and tensor parallelism (mla_inductor.distributed) against one process.

Three kinds of test:
- the layout and the math in one process (each rank's local step simulated in turn, then merged);
- real process groups on CPU (gloo, 2 and 4 processes spawned from pytest): each process computes the
  one-process result itself and compares its own heads' share; one spawn per world size runs every case,
  since starting processes is what costs;
- GPU: each rank's local step on one GPU (its shard, its lengths) against the single-GPU result, and the
  NCCL runs, which need 2 GPUs and are skipped with fewer.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla_inductor  # noqa: F401
from mla_inductor.distributed import (
    DCPGroup,
    DCPLatentCache,
    DCPLayout,
    agreed_fp8_scale,
    dcp_decode_with_lse,
    local_decode_with_lse,
    make_dcp_group,
    split_heads,
)
from mla_inductor.cache import PagedLatentCache, fp8_scale_for
from mla_inductor.testing import TOLERANCE, make_decode_inputs, relative_error

HAS_CUDA = torch.cuda.is_available()
LENS = [0, 1, 3, 37, 70]  # an empty sequence, shards left empty, lengths that are no multiple of I
SMALL = dict(kv_lora_rank=64, rope_dim=16)  # the reference on CPU: small dims keep it quick
DEEPSEEK = dict(kv_lora_rank=512, rope_dim=64)  # on GPUs: the dims the GPU kernels are built for


def dims_on(device) -> dict:
    return DEEPSEEK if torch.device(device).type == "cuda" else SMALL


def one_process_and_shards(N, interleave, fmt, *, q_per_seq=1, num_heads=4, page=8, seed=0, device="cpu",
                           lens=LENS, **dims):
    """The one-process inputs (pages of page * N tokens) and each rank's cache shard."""
    dims = dims or SMALL
    x = make_decode_inputs(lens, num_heads=num_heads, q_per_seq=q_per_seq, page_size=page * N, fmt=fmt, seed=seed,
                           device=device, **dims)
    shards = [DCPLayout(N, r, interleave).shard_cache(x.kv_cache) for r in range(N)]
    return x, shards


def one_process_result(x):
    return torch.ops.mla.paged_decode_with_lse(*x.args()[:7])


def bounds(device, fmt: str, kernels: int = 1) -> tuple[float, float]:
    """Relative-error bounds (out, lse) of a bf16-query result. On CPU every result is the reference's, with
    the output rounded to bf16. GPU kernels compute the logits from bf16 operands, and their fp8-cache paths
    quantize the query to fp8 too (the bounds of tests/test_backend_flashmla.py); ``kernels``: how many GPU
    results were compared (each brings its own rounding)."""
    if torch.device(device).type != "cuda":
        return TOLERANCE[torch.bfloat16], 1e-5
    out, lse = (3e-2, 1e-2) if fmt.startswith("fp8") else (TOLERANCE[torch.bfloat16], 1e-3)
    return out * kernels, lse * kernels


def assert_close_to(got, want, what, bound=(TOLERANCE[torch.bfloat16], 1e-5)):
    (out, lse), (want_out, want_lse) = got, want
    err = relative_error(out.float(), want_out.float())
    assert err < bound[0], f"{what}: out off by {err:.2e}"
    err = relative_error(lse, want_lse)
    assert err < bound[1], f"{what}: lse off by {err:.2e}"


# --------------------------------------------------------------------------------------------------------
# One process


@pytest.mark.parametrize("N, interleave", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 1), (4, 4)])
def test_layout_places_every_token_once_in_order(N, interleave):
    positions = torch.arange(200)
    layouts = [DCPLayout(N, r, interleave) for r in range(N)]
    owners = layouts[0].owner(positions)
    for r, layout in enumerate(layouts):
        mine = positions[owners == r]
        assert torch.equal(layout.local_position(mine), torch.arange(len(mine))), "local positions must be 0, 1, ..."
        counts = torch.stack([(mine < n).sum() for n in range(201)])
        assert torch.equal(layout.local_lengths(torch.arange(201)), counts)
    assert torch.equal(sum(l.local_lengths(torch.arange(-3, 201)) for l in layouts), torch.arange(-3, 201).clamp(0))


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="page_size .* multiple of the interleave size 4"):
        DCPLayout(2, 0, 4).check_page_size(6)
    with pytest.raises(ValueError, match="rank < world_size"):
        DCPLayout(2, 2)


@pytest.mark.parametrize("N, interleave", [(2, 1), (3, 2), (4, 4)])
def test_local_slots_point_at_the_shard_rows(N, interleave):
    page = 4
    x, shards = one_process_and_shards(N, interleave, "fp32", page=page)
    flat = x.kv_cache.reshape(-1, x.kv_cache.shape[-1])
    slots = torch.arange(flat.shape[0] + 1) - 1  # -1 (padding) and every slot
    found = torch.zeros(flat.shape[0], dtype=torch.int64)
    for r in range(N):
        local = DCPLayout(N, r, interleave).local_slots(slots, page)
        assert local.dtype == slots.dtype and int(local[0]) == -1
        mine = local >= 0
        found[slots[mine]] += 1
        assert torch.equal(shards[r].reshape(-1, flat.shape[1])[local[mine]], flat[slots[mine]])
    assert bool((found == 1).all()), "every token must live on exactly one rank"


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("N, interleave, q_per_seq", [(2, 1, 1), (2, 4, 2), (3, 2, 1), (4, 4, 1)])
def test_local_steps_merged_equal_one_process(fmt, N, interleave, q_per_seq):
    """The math of DCP without communication: every rank's local step, merged, is the one-process decode."""
    dims = dict(kv_lora_rank=512, rope_dim=64) if fmt == "fp8_ds_mla" else SMALL
    x, shards = one_process_and_shards(N, interleave, fmt, q_per_seq=q_per_seq, seed=N, **dims)
    parts = [local_decode_with_lse(x.q_nope, x.q_pe, shards[r], x.block_table, x.seq_lens, x.softmax_scale,
                                   x.kv_scale, DCPLayout(N, r, interleave)) for r in range(N)]
    merged = torch.ops.mla.merge_attn_states_n(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    assert_close_to(merged, one_process_result(x), f"{fmt} N={N} I={interleave} Q={q_per_seq}")


def test_eager_local_decodes_of_a_step_share_one_lengths_tensor_one_plan_and_the_host_copy():
    """Eager DCP calls derive this rank's lengths once per seq_lens state (``STEP_LENGTHS``): a step's layers
    get one tensor, so a backend's plan cache plans once per step, and seq_lens' registered host copy gives
    this rank's host copy (a host-planning backend then waits for nothing). A write of seq_lens starts over."""
    import planned_backend as pb

    from mla_inductor import backends
    from mla_inductor.cache import host_lengths, register_host_lengths
    from mla_inductor.distributed import STEP_LENGTHS

    x, shards = one_process_and_shards(2, 1, "bf16", seed=5)
    layout = DCPLayout(2, 0)
    backends.register_backend("planned_test", "planned_backend")
    try:
        pb.PLANS.forget()
        pb.PLANS_MADE.clear()
        with mla_inductor.prefer_backends("planned_test"):
            for step in range(3):
                if step:
                    x.seq_lens.copy_((x.seq_lens - 1).clamp_min(0))  # the next step's lengths
                if step < 2:
                    register_host_lengths(x.seq_lens, x.seq_lens.clone())
                want = layout.local_lengths(x.seq_lens)
                lengths = [STEP_LENGTHS.of(layout, x.seq_lens) for _ in range(3)]
                assert lengths[0] is lengths[1] is lengths[2] and torch.equal(lengths[0], want)
                host = host_lengths(lengths[0])
                assert (host is None) == (step == 2) and (host is None or torch.equal(host, want))
                for _ in range(3):  # three layers; the run op checks it got the plan of these lengths
                    out, lse = local_decode_with_lse(x.q_nope, x.q_pe, shards[0], x.block_table, x.seq_lens,
                                                     x.softmax_scale, x.kv_scale, layout)
                assert len(pb.PLANS_MADE) == step + 1, "one plan per step"
                ref_out, ref_lse = mla_inductor.paged_decode_reference(x.q_nope, x.q_pe, shards[0], x.block_table,
                                                                       want, x.softmax_scale, x.kv_scale)
                assert relative_error(out, ref_out) < 1e-2 and torch.equal(lse.isinf(), ref_lse.isinf())
        # Another rank's layout gets its own lengths.
        assert torch.equal(STEP_LENGTHS.of(DCPLayout(2, 1), x.seq_lens), DCPLayout(2, 1).local_lengths(x.seq_lens))
    finally:
        backends.unregister_backend("planned_test")


# --------------------------------------------------------------------------------------------------------
# Process groups on CPU (gloo), spawned from pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cases(rank, world, port, backend, cases, errors):
    """A spawned process: join the group, run every case, report failures (with the case) in ``errors``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    try:
        for case in cases:
            try:
                CASES[case[0]](device, *case[1:])
            except Exception:  # noqa: BLE001 - reported to the parent with the case that failed
                errors.put(f"rank {rank}, case {case}:\n{traceback.format_exc()}")
                raise
    finally:
        dist.destroy_process_group()


# Processes start from a fork server that has imported torch, dynamo (which the first op call imports),
# Inductor, the package and this module once: forking it costs far less than a fresh interpreter per process
# importing them again. No op has run in it, so it has started no thread pool a fork could leave locked
# (transformers is left out: it starts a thread of its own at import). CPU runs only: see spawn().
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "triton", "sympy", "mla_inductor", "mla_inductor.distributed",
            "mla_inductor.hf", "mla_inductor.lowering", "test_distributed"]


def spawn(world, cases, backend="gloo"):
    # GPU runs start each child afresh: a forked child cannot use CUDA once its parent has asked anything of it,
    # and importing torch's compiler stack asks torch.cuda.is_available() (2 x H100: "Cannot re-initialize CUDA
    # in forked subprocess", from a forkserver that had only imported the modules above).
    method = "spawn" if backend == "nccl" else "forkserver"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    errors = context.SimpleQueue()
    try:
        mp.start_processes(_run_cases, args=(world, free_port(), backend, cases, errors), nprocs=world, join=True,
                           start_method=method)
    except Exception as e:  # noqa: BLE001
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        raise AssertionError("\n".join(reports) or str(e)) from None


def case_dcp_attention(device, exchange, fmt, interleave, q_per_seq, q_dtype=torch.bfloat16):
    """DCP over the whole world: this rank's heads of the one-process decode."""
    N, rank = dist.get_world_size(), dist.get_rank()
    dcp = DCPGroup.from_group(interleave=interleave, exchange=exchange)
    on_gpu = torch.device(device).type == "cuda"
    x, shards = one_process_and_shards(N, interleave, fmt, q_per_seq=q_per_seq, num_heads=(64 if on_gpu else 2) * N,
                                       seed=7, device=device, page=64 if on_gpu else 8, q_dtype=q_dtype,
                                       lens=LENS + [1000, 4097] if on_gpu else LENS, **dims_on(device))
    got = dcp_decode_with_lse(split_heads(x.q_nope, N, rank), split_heads(x.q_pe, N, rank), shards[rank],
                              x.block_table, x.seq_lens, x.softmax_scale, x.kv_scale, dcp)
    out, lse = one_process_result(x)
    assert_close_to(got, (split_heads(out, N, rank), split_heads(lse, N, rank)),
                    f"DCP={N} {exchange} {fmt} I={interleave} Q={q_per_seq}", bounds(device, fmt, kernels=2))


def _tokens(count, dims, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, dims["kv_lora_rank"], generator=g), torch.randn(count, dims["rope_dim"], generator=g)


def case_dcp_cache(device, fmt, interleave, exchange):
    """DCPLatentCache end to end: reserve, append (each rank writes its tokens), decode, next step; an fp8 scale
    agreed from each rank's own tokens. Against one PagedLatentCache holding everything."""
    N, rank = dist.get_world_size(), dist.get_rank()
    dcp = DCPGroup.from_group(interleave=interleave, exchange=exchange)
    prompt = [5, 0, 19, 2]  # varlen, an empty sequence
    B, H, page = len(prompt), 2 * N, 4
    dims = dims_on(device)
    kv_c, k_pe = _tokens(sum(prompt) + 2 * B, dims, seed=11)
    kv_scale = 1.0
    if fmt == "fp8_e4m3":
        owners = DCPLayout(N, rank, interleave)
        # which of the prompt tokens this rank stores: position within its sequence decides
        positions = torch.cat([torch.arange(n) for n in prompt])
        mine = torch.cat([kv_c, k_pe], -1)[: sum(prompt)][owners.owner(positions) == rank]
        agreed = agreed_fp8_scale(mine.to(device), dcp.group).cpu()
        # The expected scale is computed on the same device: CUDA divides by a scalar as a multiplication by its
        # reciprocal, one ulp away from the CPU's quotient (2 x H100).
        assert torch.equal(agreed, fp8_scale_for(torch.cat([kv_c, k_pe], -1)[: sum(prompt)].to(device)).cpu())
        everything = torch.cat([kv_c, k_pe], -1)
        none_on_last = everything[:0] if rank == N - 1 else everything  # a rank holding no token at all
        assert torch.equal(agreed_fp8_scale(none_on_last.to(device), dcp.group).cpu(),
                           fp8_scale_for(everything.to(device)).cpu())
        kv_scale = float(agreed)
    sizes = dict(num_layers=1, batch_size=B, max_seq_len=32, page_size=page, fmt=fmt, kv_scale=kv_scale, device=device,
                 **dims)
    split = DCPLatentCache.allocate(dcp, **sizes)
    whole = PagedLatentCache.allocate(**dict(sizes, page_size=page * N))
    g = torch.Generator().manual_seed(12)
    used = 0
    for step, counts in enumerate([prompt, [1] * B, [1] * B]):
        n = sum(counts)
        new_c, new_pe = kv_c[used:used + n].to(device), k_pe[used:used + n].to(device)
        used += n
        split.append(0, new_c, new_pe, split.reserve(counts))
        whole.append(0, new_c, new_pe, whole.reserve(counts))
        assert torch.equal(split.seq_lens, whole.seq_lens) and torch.equal(split.block_table, whole.block_table)
        if step == 0:
            continue
        q_nope = torch.randn(B, H, dims["kv_lora_rank"], generator=g).bfloat16().to(device)
        q_pe = torch.randn(B, H, dims["rope_dim"], generator=g).bfloat16().to(device)
        got = split.decode(0, split_heads(q_nope, N, rank), split_heads(q_pe, N, rank), 0.125)
        want = whole.decode(0, q_nope, q_pe, 0.125)
        err = relative_error(got.float(), split_heads(want, N, rank).float())
        assert err < bounds(device, fmt, kernels=2)[0], f"DCPLatentCache {fmt} step {step}: off by {err:.2e}"
    assert int(split.local_seq_lens().sum()) > 0


TINY_V3 = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
               n_group=1, topk_group=1, max_position_embeddings=64, pad_token_id=0)


def case_tp_hf(device, dcp_size, exchange, fmt, attention_bias=False):
    """An HF DeepSeek-V3 with its attention split over the world by heads (TP = world size), the cache split over
    DCP groups of ``dcp_size`` ranks inside it (1: TP alone, a PagedMLACache): prefill and decode logits equal
    one process's. ``attention_bias``: o_proj (and the latent projections) with a bias, which TP adds once after
    the sum."""
    from mla_inductor import hf
    from mla_inductor.distributed import shard_deepseek_attention_tp
    from mla_inductor.hf import DCPMLACache
    from mla_inductor.testing import random_deepseek_model

    kv_scale = 0.05 if fmt == "fp8_e4m3" else 1.0
    sizes = dict(batch_size=3, max_seq_len=24, fmt=fmt, page_size=4, kv_scale=kv_scale)
    config = dict(TINY_V3, attention_bias=attention_bias)

    def build():
        model = random_deepseek_model("v3", device=device, **config)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():  # HF initialises biases to 0, which would not show a bias added tp times
            for p in model.parameters():
                if p.dim() == 1 and not p.any():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        model.set_attn_implementation(hf.register())
        return model

    whole = build()
    whole_cache = hf.PagedMLACache(whole, **sizes)
    split = shard_deepseek_attention_tp(build(), dist.group.WORLD)
    if dcp_size == 1:
        cache = hf.PagedMLACache(split, **sizes)
    else:
        cache = DCPMLACache(split, make_dcp_group(dcp_size, interleave=2, exchange=exchange), **sizes)
        assert cache.kv_caches[0].shape[1] == sizes["page_size"]  # this rank's share of every page
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, TINY_V3["vocab_size"], (3, 7), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :6] = 0
    with torch.no_grad():
        want, got = hf.prefill(whole, ids, mask, cache=whole_cache), hf.prefill(split, ids, mask, cache=cache)
        for step in range(4):
            err = relative_error(got, want)
            # On GPUs the kernels for H/tp heads and for H heads may differ (and round differently).
            assert err < (2e-2 if torch.device(device).type == "cuda" else 1e-4), \
                f"TP={dist.get_world_size()} DCP={dcp_size} {fmt}: logits off by {err:.2e} at step {step}"
            token = want.argmax(-1)
            want = hf.decode_one_token(whole, token, whole_cache)
            got = hf.decode_one_token(split, token, cache)
    assert torch.equal(cache.seq_lens, whole_cache.seq_lens)


def case_compiled_dcp_step(device, exchange):
    """A decode step (append the new token, DCP decode) under torch.compile(fullgraph=True): no graph break, and
    the compiled result equals the eager one."""
    import mla_inductor.lowering  # noqa: F401  (the reference becomes generated code)
    import torch._inductor.config
    from torch._dynamo.utils import counters

    # Compile in this process: a pool of compile workers would each import torch again, for one small graph.
    torch._inductor.config.compile_threads = 1
    N, rank = dist.get_world_size(), dist.get_rank()
    dcp = DCPGroup.from_group(interleave=1, exchange=exchange)
    B, H = 2, 2 * N
    cache = DCPLatentCache.allocate(dcp, num_layers=1, batch_size=B, max_seq_len=32, page_size=4, device=device,
                                    **SMALL)
    kv_c, k_pe = _tokens(13 + 2 * B, SMALL, seed=5)
    cache.append(0, kv_c[:13].to(device), k_pe[:13].to(device), cache.reserve([6, 7]))

    def step(q_nope, q_pe, kv_c, k_pe, slots):
        cache.append(0, kv_c, k_pe, slots)
        return cache.decode(0, q_nope, q_pe, 0.125)

    g = torch.Generator().manual_seed(6)
    q_nope = torch.randn(B, H, SMALL["kv_lora_rank"], generator=g).bfloat16().to(device)
    q_pe = torch.randn(B, H, SMALL["rope_dim"], generator=g).bfloat16().to(device)
    q = (split_heads(q_nope, N, rank), split_heads(q_pe, N, rank))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    slots = cache.reserve(1)
    got = compiled(*q, kv_c[13:15].to(device), k_pe[13:15].to(device), slots)
    want = cache.decode(0, *q, 0.125)  # the token is in the cache now: eager decode of the same state
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


CASES = {
    "dcp_attention": case_dcp_attention,
    "dcp_cache": case_dcp_cache,
    "tp_hf": case_tp_hf,
    "compiled_dcp_step": case_compiled_dcp_step,
}

DCP_ATTENTION_CASES = [("dcp_attention", exchange, fmt, interleave, q)
                       for exchange in ("ag_rs", "a2a") for fmt in ("bf16", "fp8_e4m3")
                       for interleave, q in ((1, 1), (4, 2))]
# Outputs in fp32 and fp16: the all-to-all packs the fp32 LSE as 1 resp. 2 elements of the output's dtype.
DCP_ATTENTION_CASES += [("dcp_attention", "a2a", "fp32", 2, 1, torch.float32),
                        ("dcp_attention", "a2a", "fp16", 1, 1, torch.float16)]
DCP_CACHE_CASES = [("dcp_cache", "bf16", 1, "ag_rs"), ("dcp_cache", "fp8_e4m3", 2, "a2a")]


TP_CASES = {2: [("tp_hf", 1, "ag_rs", "bf16"), ("tp_hf", 2, "a2a", "fp8_e4m3")],
            4: [("tp_hf", 2, "ag_rs", "fp8_e4m3"), ("tp_hf", 4, "a2a", "bf16", True)]}
COMPILE_CASES = [("compiled_dcp_step", "ag_rs"), ("compiled_dcp_step", "a2a")]


@pytest.mark.slow
def test_two_processes():
    spawn(2, DCP_ATTENTION_CASES + DCP_CACHE_CASES + TP_CASES[2] + COMPILE_CASES)


@pytest.mark.slow
def test_four_processes():
    spawn(4, DCP_ATTENTION_CASES + DCP_CACHE_CASES + TP_CASES[4])


# --------------------------------------------------------------------------------------------------------
# GPUs

needs_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                                    reason="needs 2 CUDA GPUs and NCCL "
                                           f"(found {torch.cuda.device_count() if HAS_CUDA else 0} GPUs)")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("N, interleave, q_per_seq", [(2, 1, 1), (2, 16, 2), (4, 1, 1)])
def test_local_steps_on_one_gpu_equal_single_gpu(fmt, N, interleave, q_per_seq):
    """Each rank's local step on the GPU (its shard of the cache, its lengths; the backend the selection picks
    for it) against the reference on that shard; merged on the GPU (the Triton merge) against the single-GPU
    decode of the whole cache. DeepSeek-V3 sizes: H=128, L=512, R=64, page 64 per rank."""
    lens = [0, 1, 63, 64, 1000, 4097, 8191]
    x, shards = one_process_and_shards(N, interleave, fmt, q_per_seq=q_per_seq, num_heads=128, page=64, seed=9,
                                       device="cuda", lens=lens, **DEEPSEEK)
    parts = []
    for r in range(N):
        layout = DCPLayout(N, r, interleave)
        local = (x.q_nope, x.q_pe, shards[r], x.block_table, x.seq_lens, x.softmax_scale, x.kv_scale, layout)
        got = local_decode_with_lse(*local)
        with mla_inductor.prefer_backends("reference"):
            want = local_decode_with_lse(*local)
        assert_close_to(got, want, f"rank {r}'s local step", bounds("cuda", fmt))
        parts.append(got)
    merged = torch.ops.mla.merge_attn_states_n(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    what = f"{fmt} N={N} I={interleave} Q={q_per_seq} merged"
    assert_close_to(merged, one_process_result(x), f"{what}, against the single-GPU decode", bounds("cuda", fmt, 2))
    with mla_inductor.prefer_backends("reference"):
        assert_close_to(merged, one_process_result(x), f"{what}, against the reference", bounds("cuda", fmt))


@pytest.mark.gpu
@needs_two_gpus
def test_two_gpus_nccl():
    """The CPU process-group cases on 2 GPUs with NCCL, at the GPU kernels' dims: DCP=2 (both exchanges, bf16 and
    fp8, varlen, empty shards), the split cache, HF TP=2 and TP=2 x DCP=2, a compiled DCP step."""
    spawn(2, DCP_ATTENTION_CASES + DCP_CACHE_CASES + TP_CASES[2] + COMPILE_CASES, backend="nccl")
