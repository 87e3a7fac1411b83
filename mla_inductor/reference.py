"""The reference: the contract's meaning in plain PyTorch (float32 math).

It is the CPU kernel, the definition every GPU kernel is tested against (itself checked against an
independent float64 loop, tests/naive.py), and, traced to aten ops by the Inductor pass, the source of
the compiled CPU path. It has no data-dependent shapes, so it traces with dynamic shapes.

What it reads. Memory the call does not attend is never used, whatever it holds:

- every index is clamped into the cache before it is used (unused block-table entries and sparse
  padding may hold anything: -1, 2147480000), so nothing outside the cache is dereferenced;
- every gathered key row that no query row of the call attends is replaced by 0 with ``torch.where``
  before it enters a product. NaN/inf in a page tail, in a page behind an unused block-table entry, in
  slot 0 behind sparse -1 padding, or fp8 bytes that encode NaN (0x7F/0xFF from ``torch.empty``) never
  reach an output. Weighting such rows by 0 would not do: 0 * NaN is NaN.

How much memory. Keys are read one chunk of about ``CHUNK_POSITIONS`` positions (whole pages; for
sparse calls, listed slots) at a time with an online softmax: a running max, sum and output per query
row. A call holds one chunk's keys and logits, never the whole gathered context; the chunks run in a
``while_loop`` that stops after the longest sequence's last chunk, which Inductor generates as a loop
over kernels. A call whose whole block table (or list of slots) fits one chunk runs it without a loop.
On a GPU a while_loop would read its condition back to the host every chunk (a sync per chunk), so there
the chunks are larger (``CHUNK_POSITIONS_GPU``) and run in a Python loop over the table's static chunk
count, every chunk masked: no device->host read, in eager calls and in graphs (where the loop unrolls).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Optional

import torch

from mla_inductor._compat import while_loop
from mla_inductor.cache import cache_format, decode_tokens, encode_tokens
from mla_inductor.contract import attends_nothing, nothing_attended

Tensor = torch.Tensor

# Positions per chunk. Per chunk and sequence: the fp32 keys (L+R values), the stored rows and the
# [Q*H] logits of each position. At B=64, L+R=576 that is about 10 MB of fp32 keys per chunk.
CHUNK_POSITIONS = 64
CHUNK_POSITIONS_GPU = 1024


_any_autocast = torch._C._is_any_autocast_enabled


def autocast_off(t: Tensor):
    """A context that turns the caller's ``torch.autocast`` off on ``t``'s device type for an eager call: the
    contract fixes the math's precision (fp32), whatever region the call is made in (a compiled call traces the
    reference outside the caller's region already). A no-op context where no autocast is on."""
    return torch.autocast(t.device.type, enabled=False) if _any_autocast() else contextlib.nullcontext()


def _ceil_div(a, b):
    return (a + b - 1) // b


def _loops_on_host(device: torch.device) -> bool:
    """Whether the chunks of a call on ``device`` run in a Python loop (a GPU: no loop condition to read
    back) rather than a while_loop (the CPU: stops after the longest sequence's last chunk)."""
    return device.type != "cpu"


def _positions_per_chunk(device: torch.device) -> int:
    return CHUNK_POSITIONS_GPU if _loops_on_host(device) else CHUNK_POSITIONS


def _pages_per_chunk(max_pages, page_size, positions: int = CHUNK_POSITIONS):
    """Whole pages of about ``positions`` positions; the whole table when it is statically smaller."""
    pages = _ceil_div(positions, page_size)
    if isinstance(max_pages, int) and isinstance(pages, int):
        pages = max(1, min(pages, max_pages))
    return pages


def _slots_per_chunk(topk, positions: int = CHUNK_POSITIONS):
    if isinstance(topk, int):
        return max(1, min(positions, topk))
    return positions


def dense_chunk(chunk: Tensor, block_table: Tensor, seq_lens: Tensor, num_pages: int, page_size: int,
                q_per_seq: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where chunk ``chunk`` (0-d int64) of every sequence lives, and who attends it.

    Returns ``pages`` and ``offsets`` int64 [B, S_c] (clamped into the cache) and ``attended`` bool
    [B, Q, S_c]: query row ``b*Q + j`` attends position t iff ``t <= seq_lens[b] - Q + j`` and t lies
    inside the block table.
    """
    max_pages = block_table.shape[1]
    chunk_pages = _pages_per_chunk(max_pages, page_size, _positions_per_chunk(block_table.device))
    table_cols = chunk * chunk_pages + torch.arange(chunk_pages, device=block_table.device)
    pages = block_table.index_select(1, table_cols.clamp(max=max_pages - 1)).long().clamp(0, num_pages - 1)
    within = torch.arange(chunk_pages * page_size, device=block_table.device)
    positions = chunk * (chunk_pages * page_size) + within  # [S_c]
    pages = pages.repeat_interleave(page_size, dim=1)  # [B, S_c]
    offsets = (within % page_size).expand_as(pages)
    last = seq_lens.long()[:, None] - q_per_seq + torch.arange(q_per_seq, device=seq_lens.device)  # [B, Q]
    attended = (positions <= last[:, :, None]) & (positions < max_pages * page_size)
    return pages, offsets, attended


def sparse_chunk(chunk: Tensor, sparse_indices: Tensor, num_pages: int, page_size: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Listed slots of chunk ``chunk`` of every row: ``pages``, ``offsets`` int64 [T, S_c] (clamped into the
    cache) and ``attended`` bool [T, 1, S_c] (a slot in [0, P * page_size); -1 padding and anything
    else out of range attend nothing)."""
    topk = sparse_indices.shape[1]
    width = _slots_per_chunk(topk, _positions_per_chunk(sparse_indices.device))
    cols = chunk * width + torch.arange(width, device=sparse_indices.device)
    slots = sparse_indices.index_select(1, cols.clamp(max=topk - 1)).long()
    attended = (slots >= 0) & (slots < num_pages * page_size) & (cols < topk)
    slots = slots.clamp(0, num_pages * page_size - 1)
    return slots // page_size, slots % page_size, attended[:, None, :]


def online_softmax_step(state: tuple[Tensor, Tensor, Tensor], q_nope: Tensor, q_pe: Tensor, stored: Tensor,
                        attended: Tensor, kv_scale: Tensor, softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Fold one chunk of keys into the running (max, sum, output) of each query row.

    q_nope [T, H, L] and q_pe [T, H, R] fp32, contiguous; the T rows form G groups of Qg = T / G
    consecutive rows that share keys (sequences for dense calls, single rows for sparse ones).
    ``stored`` [G, S_c, width]: the chunk's cache rows as stored; ``attended`` bool [G, Qg, S_c].
    state: max and sum [T, H], output [T, H, L], fp32.
    """
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    G, S_c = stored.shape[0], stored.shape[1]
    Qg = T // G
    row_max, total, acc = state
    used = attended.any(dim=1)  # [G, S_c]: attended by some row of the group
    keys = torch.where(used[..., None], decode_tokens(stored, kv_scale), 0.0)  # garbage never reaches a product
    latent = keys[..., :L]
    logits = torch.bmm(q_nope.view(G, Qg * H, L), latent.transpose(1, 2))
    logits = logits + torch.bmm(q_pe.view(G, Qg * H, R), keys[..., L:].transpose(1, 2))
    # The running max is kept of the unscaled logits (times the scale's sign) and the scale applied to the
    # (non-positive) differences, so a huge scale (1e38) gives the limit, a one-hot softmax, where scaling
    # first overflows to inf - inf. ``row_max`` is in those units; the lse multiplies it by ``scale``.
    sign, scale = (1.0, softmax_scale) if softmax_scale >= 0 else (-1.0, -softmax_scale)
    seen = attended[:, :, None, :].expand(G, Qg, H, S_c).reshape(T, H, S_c)
    logits = torch.where(seen, logits.view(T, H, S_c) * sign, float("-inf"))
    new_max = torch.maximum(row_max, logits.amax(dim=-1))
    # Rows that have seen nothing yet keep max -inf; shift them by 0 so exp() gives 0, not NaN.
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)
    weights = torch.exp(torch.where(seen, (logits - shift[..., None]) * scale, float("-inf")))
    rescale = torch.where(row_max == float("-inf"), 0.0, torch.exp((row_max - shift) * scale))
    total = total * rescale + weights.sum(dim=-1)
    pv = torch.bmm(weights.view(G, Qg * H, S_c), latent).view(T, H, L)
    acc = acc * rescale[..., None] + pv
    return new_max, total, acc


def _run_chunks(step, num_chunks_static, num_chunks: Tensor, state, inputs):
    """Fold chunks 0..num_chunks-1 with ``step(chunk, state, *inputs) -> state``: once, without a loop,
    when there is statically at most one chunk; else in a while_loop."""
    if isinstance(num_chunks_static, int) and (num_chunks_static <= 1 or _loops_on_host(num_chunks.device)):
        # Every chunk, masked, in a Python loop: no loop condition to read back from a GPU.
        for chunk in range(num_chunks_static):
            state = step(torch.full((), chunk, dtype=torch.int64, device=num_chunks.device), state, *inputs)
        return state

    def cond(chunk, row_max, total, acc, *extra):
        return chunk < extra[-1]

    def body(chunk, row_max, total, acc, *extra):
        return (chunk + 1, *step(chunk, (row_max, total, acc), *extra[:-1]))

    start = torch.zeros((), dtype=torch.int64, device=num_chunks.device)
    _, *state = while_loop(cond, body, (start, *state), (*inputs, num_chunks))
    return tuple(state)


def paged_decode_reference(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    softmax_scale: float,
    kv_scale: Tensor,
    sparse_indices: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The contract of ``mla.paged_decode_with_lse``: returns (out [T, H, L] in q's dtype, lse [T, H] fp32).

    With ``sparse_indices`` every listed slot is one key: a slot listed twice counts twice.
    """
    if attends_nothing(q_nope, kv_cache, block_table, sparse_indices):  # no rows, pages or slots to index
        return nothing_attended(q_nope)
    T, H, L = q_nope.shape
    page_size = kv_cache.shape[1]
    device = q_nope.device
    positions = _positions_per_chunk(device)
    if sparse_indices is None:
        chunk_len = _pages_per_chunk(block_table.shape[1], page_size, positions) * page_size
        num_static = _ceil_div(block_table.shape[1] * page_size, chunk_len)
        # Only as many chunks as the longest sequence needs (0 for an empty batch).
        longest = torch.nn.functional.pad(seq_lens.long(), (0, 1)).amax()
        num_chunks = _ceil_div(longest, chunk_len).clamp(0, num_static)

        def step(chunk, state, qn, qp, cache, table, lens, scale):
            q_per_seq = qn.shape[0] // table.shape[0]
            pages, offsets, attended = dense_chunk(chunk, table, lens, cache.shape[0], cache.shape[1], q_per_seq)
            return online_softmax_step(state, qn, qp, cache[pages, offsets], attended, scale, softmax_scale)

        index_inputs = (block_table, seq_lens)
    else:
        topk = sparse_indices.shape[1]
        num_static = _ceil_div(topk, _slots_per_chunk(topk, positions))
        num_chunks = torch.full((), num_static, dtype=torch.int64, device=device)

        def step(chunk, state, qn, qp, cache, indices, lens, scale):
            pages, offsets, attended = sparse_chunk(chunk, indices, cache.shape[0], cache.shape[1])
            return online_softmax_step(state, qn, qp, cache[pages, offsets], attended, scale, softmax_scale)

        # seq_lens is unread here, but a loop input: the compiler may have written T as Q * B (the pass fixes
        # Q, a model constant), and the loop body can only size its tensors from its inputs' sizes.
        index_inputs = (sparse_indices, seq_lens)
    # The loop's tensors keep T, H, L as their own sizes (no T / B): a loop body's sizes must be
    # computable from its inputs' sizes when Inductor generates it with dynamic shapes.
    state = (torch.full((T, H), float("-inf"), device=device), torch.zeros(T, H, device=device),
             torch.zeros(T, H, L, device=device))
    inputs = (q_nope.float().contiguous(), q_pe.float().contiguous(), kv_cache, *index_inputs, kv_scale)
    row_max, total, acc = _run_chunks(step, num_static, num_chunks, state, inputs)
    # A row with nothing to attend: out 0, lse -inf. A NaN sum (NaN in q or in an attended key) stays NaN in
    # out and lse: lse -inf would call the row empty, and a merge would drop it.
    seen = total != 0
    out = acc / torch.where(seen, total, 1.0)[..., None]
    sign_scale = softmax_scale if softmax_scale >= 0 else -softmax_scale
    lse = torch.where(seen, torch.log(total) + row_max * sign_scale, float("-inf"))
    return out.to(q_nope.dtype), lse


def cache_append_reference(kv_cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_scale: Tensor) -> None:
    """The contract of ``mla.cache_append``: writes encoded rows into their slots in place (-1 skipped).

    A slot listed twice raises ValueError before anything is written: which of the two tokens a slot
    would hold is not something every device can promise (GPU programs write rows concurrently).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    listed = slots.tolist()  # a host list: far cheaper than torch.unique for a decode step's few slots
    if len(set(listed)) != len(listed):
        repeated, times = collections.Counter(listed).most_common(1)[0]
        raise ValueError(f"mla.cache_append: slot_mapping must list each slot at most once (-1 may repeat); "
                         f"slot {repeated} is listed {times} times")
    rows = torch.cat([kv_c[keep].float(), k_pe[keep].float()], dim=-1)
    flat = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[-1])
    flat[slots] = encode_tokens(rows, cache_format(kv_cache), kv_scale)
