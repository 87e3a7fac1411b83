"""The test oracle: a second, deliberately simple definition of the contract, in float64.

Independent of ``mla_inductor`` (it imports nothing from it; it decodes the cache bytes itself), written
from docs/contract.md: one sequence at a time, one query row at a time, Python loops over positions.
It reads exactly the cache rows a row attends and nothing else, so whatever lies in memory the call
does not attend (NaN, inf, NaN-encoding fp8 bytes, pages behind unused block-table entries) cannot
reach its result: a kernel that lets such memory through disagrees with it.
"""

import torch

FP8_DS_MLA_LATENT, FP8_DS_MLA_SCALES_END, FP8_DS_MLA_TILE = 512, 528, 128


def rows_as_float64(stored: torch.Tensor, kv_scale) -> torch.Tensor:
    """Stored cache rows [N, width] -> [N, L+R] float64 values (fp8 scales applied)."""
    if stored.dtype == torch.uint8:  # fp8_ds_mla: 512 e4m3 | 4 fp32 tile scales | 64 bf16 rope
        latent = stored[:, :FP8_DS_MLA_LATENT].contiguous().view(torch.float8_e4m3fn).double()
        scales = stored[:, FP8_DS_MLA_LATENT:FP8_DS_MLA_SCALES_END].contiguous().view(torch.float32).double()
        latent = latent * scales.repeat_interleave(FP8_DS_MLA_TILE, dim=1)
        rope = stored[:, FP8_DS_MLA_SCALES_END:].contiguous().view(torch.bfloat16).double()
        return torch.cat([latent, rope], dim=1)
    if stored.dtype == torch.float8_e4m3fn:
        return stored.double() * float(kv_scale.reshape(()))
    return stored.double()


def read_slots(kv_cache: torch.Tensor, slots: list, kv_scale) -> torch.Tensor:
    """The listed flat slots (page * page_size + offset) of the cache, in order, as float64 [N, L+R]."""
    page_size = kv_cache.shape[1]
    pages = torch.tensor([s // page_size for s in slots], dtype=torch.long)
    offsets = torch.tensor([s % page_size for s in slots], dtype=torch.long)
    return rows_as_float64(kv_cache.cpu()[pages, offsets], kv_scale.cpu())


def sequence_slots(block_table: torch.Tensor, b: int, length: int, page_size: int) -> list:
    """Flat slots of positions 0..length-1 of sequence b (only the used block-table entries are read)."""
    pages = [int(block_table[b, i]) for i in range(-(-length // page_size))]
    return [pages[t // page_size] * page_size + t % page_size for t in range(length)]


def attend(q: torch.Tensor, keys: torch.Tensor, softmax_scale: float, L: int):
    """q [H, L+R], keys [S, L+R] float64 -> (out [H, L], lse [H]); S = 0 gives (0, -inf)."""
    H = q.shape[0]
    if keys.shape[0] == 0:
        return torch.zeros(H, L, dtype=torch.float64), torch.full((H,), float("-inf"), dtype=torch.float64)
    logits = q @ keys.T * softmax_scale
    return torch.softmax(logits, dim=-1) @ keys[:, :L], torch.logsumexp(logits, dim=-1)


def naive_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    """(out [T, H, L], lse [T, H]) in float64 on the CPU; see docs/contract.md.

    Dense: row ``b*Q + j`` attends positions ``0 .. seq_lens[b] - Q + j`` of sequence b. Sparse: row i
    attends its listed slots in order, -1 (any negative value) being padding; a slot listed twice is
    two keys.
    """
    T, H, L = q_nope.shape
    B = block_table.shape[0]
    Q = T // max(B, 1)  # B = 0: no rows
    page_size = kv_cache.shape[1]
    capacity = kv_cache.shape[0] * page_size
    q_all = torch.cat([q_nope, q_pe], dim=-1).double().cpu()
    block_table, seq_lens = block_table.cpu(), seq_lens.cpu()
    out = torch.zeros(T, H, L, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        length = int(seq_lens[b])
        context = None
        if sparse_indices is None and length > 0:
            context = read_slots(kv_cache, sequence_slots(block_table, b, length, page_size), kv_scale)
        for j in range(Q):
            row = b * Q + j
            if sparse_indices is None:
                visible = max(0, length - Q + j + 1)
                keys = context[:visible] if visible else torch.zeros(0, q_all.shape[-1], dtype=torch.float64)
            else:
                slots = [int(s) for s in sparse_indices[row].cpu() if int(s) >= 0]
                if any(s >= capacity for s in slots):
                    raise ValueError(f"sparse slot out of the cache's {capacity} slots in row {row}: {slots}")
                keys = read_slots(kv_cache, slots, kv_scale) if slots else torch.zeros(0, q_all.shape[-1],
                                                                                        dtype=torch.float64)
            out[row], lse[row] = attend(q_all[row], keys, softmax_scale, L)
    return out, lse
