"""The reference against a naive per-row float64 loop, and the cache writer's round trips."""

import math

import pytest
import torch

import mla_inductor
from mla_inductor.cache import decode_tokens, pack_fp8_ds_mla, unpack_fp8_ds_mla
from mla_inductor.testing import TOLERANCE, make_decode_inputs, relative_error
from grids import compiled_decode, step_args
from naive import naive_decode
from poison import GARBAGE, HUGE_PAGE_ID, poisoned

CASES = [
    # seq_lens, heads, Q, L, R, page_size, fmt, topk
    ([5, 17, 1], 4, 1, 32, 16, 8, "fp32", None),
    ([64, 3], 3, 1, 32, 16, 16, "bf16", None),
    ([9, 12], 2, 3, 32, 16, 4, "fp16", None),  # MTP: 3 new tokens per sequence, causal among them
    ([33], 5, 1, 32, 16, 1, "fp8_e4m3", None),
    ([20, 7, 0], 2, 1, 512, 64, 6, "fp8_ds_mla", None),  # seq_len 0: nothing to attend
    ([40, 10], 4, 1, 32, 16, 8, "bf16", 12),  # sparse, the short row padded with -1
    ([30, 30], 2, 2, 512, 64, 16, "fp8_ds_mla", 8),
]


@pytest.mark.parametrize("seq_lens,H,Q,L,R,page,fmt,topk", CASES)
def test_reference_matches_naive_loop(seq_lens, H, Q, L, R, page, fmt, topk):
    x = make_decode_inputs(seq_lens, num_heads=H, q_per_seq=Q, kv_lora_rank=L, rope_dim=R, page_size=page,
                           fmt=fmt, q_dtype=torch.float32, topk=topk, seed=len(seq_lens) * 7 + page)
    out, lse = mla_inductor.paged_decode_reference(*x.args())
    want_out, want_lse = naive_decode(*x.args())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert relative_error(out, want_out) < 1e-5
    assert relative_error(lse, want_lse) < 1e-5


def test_row_with_nothing_to_attend_gives_zero_and_minus_inf():
    x = make_decode_inputs([0, 5], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32)
    out, lse = torch.ops.mla.paged_decode_with_lse(*x.args())
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], float("-inf")))
    assert torch.isfinite(lse[1]).all()


def test_all_padding_sparse_row():
    x = make_decode_inputs([9, 9], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32,
                           topk=4)
    x.sparse_indices[1] = -1
    out, lse = torch.ops.mla.paged_decode_with_lse(*x.args())
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())


def test_output_dtype_follows_query():
    x = make_decode_inputs([7], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, fmt="fp32",
                           q_dtype=torch.bfloat16)
    assert torch.ops.mla.paged_decode(*x.args()).dtype == torch.bfloat16


def test_fp8_ds_mla_pack_roundtrip():
    rows = torch.randn(3, 5, 576) * 3
    packed = pack_fp8_ds_mla(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 656)
    back = unpack_fp8_ds_mla(packed)
    assert torch.equal(back[..., 512:], rows[..., 512:].bfloat16().float())  # rope is stored in bf16
    assert relative_error(back[..., :512], rows[..., :512]) < 0.05  # e4m3 keeps 3 mantissa bits
    assert torch.equal(unpack_fp8_ds_mla(pack_fp8_ds_mla(torch.zeros(1, 576))), torch.zeros(1, 576))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"])
def test_cache_append_roundtrip(fmt):
    L, R = (512, 64) if fmt == "fp8_ds_mla" else (32, 16)
    cache = mla_inductor.PagedLatentCache.allocate(num_layers=1, batch_size=2, max_seq_len=20, kv_lora_rank=L,
                                                   rope_dim=R, page_size=4, fmt=fmt,
                                                   kv_scale=0.01 if fmt == "fp8_e4m3" else 1.0)
    slots = cache.reserve([6, 3])
    kv_c, k_pe = torch.randn(9, L), torch.randn(9, R)
    before = cache.kv_caches[0].clone()
    cache.append(0, kv_c, k_pe, slots)
    flat = cache.kv_caches[0].reshape(-1, cache.kv_caches[0].shape[-1])
    got = decode_tokens(flat[slots.long()], cache.kv_scale)
    want = torch.cat([kv_c, k_pe], -1)
    bound = {"fp32": 0, "bf16": 8e-3, "fp16": 1e-3, "fp8_e4m3": 0.07, "fp8_ds_mla": 0.07}[fmt]
    assert relative_error(got, want) <= bound
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(flat[untouched].view(torch.uint8), before.reshape(flat.shape)[untouched].view(torch.uint8))


def test_cache_append_skips_minus_one_and_saturates_fp8():
    kv_cache = torch.zeros(2, 2, 6, dtype=torch.float8_e4m3fn)
    kv_c = torch.tensor([[1000.0, -1000.0, 1, 2], [5, 5, 5, 5]])
    k_pe = torch.tensor([[3.0, 4.0], [5.0, 5.0]])
    torch.ops.mla.cache_append(kv_cache, kv_c, k_pe, torch.tensor([2, -1], dtype=torch.int32), torch.ones(1))
    flat = kv_cache.reshape(4, 6).float()
    assert flat[2].tolist() == [448.0, -448.0, 1.0, 2.0, 3.0, 4.0]
    assert bool((flat[[0, 1, 3]] == 0).all())


# ----------------------------------------------------------------------------- memory the call does not attend
# Eager on CPU runs the reference; compiled on CPU runs the Inductor code generated from it. Both must give
# the oracle's result (which reads attended rows only) whatever lies in the rest of the cache.

def _decode_step(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices):
    return torch.ops.mla.paged_decode_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale,
                                               kv_scale, sparse_indices)


def _issue_repro_inputs():
    """Issue 14's repro: seq 0 `len 3, table [1, -1]`, seq 1 `len 8, table [0, 2]`, NaN at seq 1's position 2."""
    g = torch.Generator().manual_seed(14)
    kv_cache = torch.randn(3, 4, 48, generator=g)
    kv_cache[0, 2] = float("nan")  # seq 1, position 2: page 0, offset 2 (also what seq 0's -1 entry clamps to)
    block_table = torch.tensor([[1, -1], [0, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([3, 8], dtype=torch.int32)
    q_nope, q_pe = torch.randn(2, 2, 32, generator=g), torch.randn(2, 2, 16, generator=g)
    return q_nope, q_pe, kv_cache, block_table, seq_lens, 0.25, torch.ones(1), None


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_issue_repro_nan_in_another_sequence_stays_there(mode):
    args = _issue_repro_inputs()
    step = torch.compile(_decode_step, fullgraph=True) if mode == "compiled" else _decode_step
    torch._dynamo.reset()
    out, lse = step(*args)
    want_out, want_lse = naive_decode(*args)
    assert relative_error(out[0], want_out[0]) < 1e-5 and relative_error(lse[0], want_lse[0]) < 1e-5
    assert bool(out[1].isnan().all())  # seq 1 does attend its NaN: NaN is its right answer


HOSTILE = {
    # name: make_decode_inputs arguments (L=32, R=16 unless fp8_ds_mla)
    "dense_chunks": dict(seq_lens=[150, 3, 0, 77], page_size=4),  # several chunks, a zero length, odd tails
    "page1": dict(seq_lens=[70, 1], page_size=1),
    "mtp_q3": dict(seq_lens=[66, 2, 9], page_size=16, q_per_seq=3),  # Q > seq_len for the second sequence
    "sparse": dict(seq_lens=[90, 20], page_size=8, topk=70),  # padded rows: -1 behind slot 0's garbage
}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("variant", sorted(HOSTILE))
def test_unattended_memory_never_reaches_the_output_eager(variant, garbage, fmt):
    big = fmt == "fp8_ds_mla"
    x = make_decode_inputs(**HOSTILE[variant], num_heads=3, kv_lora_rank=512 if big else 32, rope_dim=64 if big else 16,
                           fmt=fmt, q_dtype=torch.float32, max_pages=None, seed=len(variant))
    for table_fill in (HUGE_PAGE_ID, -1):
        bad = poisoned(x, garbage=garbage, table_fill=table_fill)
        out, lse = torch.ops.mla.paged_decode_with_lse(*bad.args())
        want_out, want_lse = naive_decode(*bad.args())
        assert relative_error(out, want_out) < 1e-5, (table_fill, out)
        assert relative_error(lse, want_lse) < 1e-5, (table_fill, lse)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,variant", [("fp32", "dense_chunks"), ("bf16", "mtp_q3"), ("fp8_e4m3", "sparse"),
                                         ("fp8_ds_mla", "dense_chunks")])
def test_unattended_memory_never_reaches_the_output_compiled(fmt, variant):
    big = fmt == "fp8_ds_mla"
    x = make_decode_inputs(**HOSTILE[variant], num_heads=3, kv_lora_rank=512 if big else 32, rope_dim=64 if big else 16,
                           fmt=fmt, q_dtype=torch.bfloat16, seed=3)
    with compiled_decode(x.softmax_scale) as (step, counter):
        for garbage in GARBAGE:
            bad = poisoned(x, garbage=garbage)
            out, lse = step(*step_args(bad))
            want_out, want_lse = naive_decode(*bad.args())
            assert relative_error(out, want_out) < TOLERANCE[torch.bfloat16], garbage
            assert relative_error(lse, want_lse) < 1e-5, garbage
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- repeated slots
def test_sparse_slot_listed_twice_counts_twice():
    x = make_decode_inputs([30, 30], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=4, q_dtype=torch.float32,
                           topk=4)
    once = x.sparse_indices.clone()
    once[:, 1:] = -1
    twice = once.clone()
    twice[:, 2] = once[:, 0]
    out1, lse1 = torch.ops.mla.paged_decode_with_lse(*x.args()[:-1], once)
    out2, lse2 = torch.ops.mla.paged_decode_with_lse(*x.args()[:-1], twice)
    assert torch.allclose(out1, out2, atol=1e-6)  # softmax over two equal keys: the same average
    assert torch.allclose(lse2, lse1 + math.log(2), atol=1e-5)  # but twice the weight
    want_out, want_lse = naive_decode(*x.args()[:-1], twice)
    assert relative_error(lse2, want_lse) < 1e-6


def test_cache_append_refuses_a_slot_listed_twice():
    kv_cache = torch.zeros(2, 2, 6)
    before = kv_cache.clone()
    kv_c, k_pe = torch.randn(3, 4), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"mla\.cache_append: slot_mapping .* slot 1 .*2 times"):
        torch.ops.mla.cache_append(kv_cache, kv_c, k_pe, torch.tensor([1, -1, 1]), torch.ones(1))
    assert torch.equal(kv_cache, before)  # nothing written
    torch.ops.mla.cache_append(kv_cache, kv_c, k_pe, torch.tensor([1, -1, -1]), torch.ones(1))  # -1 twice is fine
    assert torch.equal(kv_cache.reshape(4, 6)[1], torch.cat([kv_c[0], k_pe[0]]))


def test_lse_error_is_absolute_for_small_lses_relative_for_large_ones():
    from mla_inductor.testing import lse_error

    small = torch.tensor([[-4e-4]], dtype=torch.float64)  # one key whose logit is near zero
    assert lse_error(torch.tensor([[-2e-4]]), small) == pytest.approx(2e-4)  # relative_error: 0.5
    large = torch.tensor([100.0, -100.0], dtype=torch.float64)
    assert lse_error(large.float() * 1.01, large) == pytest.approx(0.01, rel=1e-4)
    ninf = torch.tensor([1.0, float("-inf")], dtype=torch.float64)
    assert lse_error(torch.tensor([1.0, 0.0]), ninf) == float("inf")  # a row that sees nothing must be -inf
    assert lse_error(torch.tensor([float("nan"), float("-inf")]), ninf) == float("inf")


@pytest.mark.parametrize("kw", [dict(seq_lens=[1500, 3, 0, 777], page_size=16),
                                dict(seq_lens=[300, 20], page_size=64, q_per_seq=3),
                                dict(seq_lens=[200, 30, 0], page_size=64, topk=1100)],
                         ids=["dense_several_chunks", "mtp_q3", "sparse_two_chunks"])
def test_gpu_chunking_runs_no_device_loop_and_matches(monkeypatch, kw):
    """On a GPU the reference runs its chunks in a Python loop (a while_loop reads its condition back to the
    host every chunk: a sync): the same results, and no while_loop, shown on the CPU by taking that path."""
    import mla_inductor.reference as reference

    kw = dict(kw)
    x = poisoned(make_decode_inputs(kw.pop("seq_lens"), num_heads=4, **kw))
    want_out, want_lse = naive_decode(*x.args())
    monkeypatch.setattr(reference, "_loops_on_host", lambda device: True)
    monkeypatch.setattr(reference, "while_loop", lambda *a: pytest.fail("a while_loop on the GPU path"))
    out, lse = reference.paged_decode_reference(*x.args())
    assert relative_error(out, want_out) < TOLERANCE[x.q_nope.dtype] and relative_error(lse, want_lse) < 1e-5
