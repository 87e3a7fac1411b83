"""A second, deliberately simple definition of the contract: one query row at a time, float64.

It shares no code with ``mla_inductor.reference`` beyond reading fp8 bytes, so the two check each other.
"""

import torch


def token_row(kv_cache, slot, kv_scale):
    row = kv_cache.reshape(-1, kv_cache.shape[-1])[slot]
    if kv_cache.dtype == torch.uint8:
        latent = row[:512].view(torch.float8_e4m3fn).double()
        scales = row[512:528].view(torch.float32).double()
        latent = latent * scales.repeat_interleave(128)
        return torch.cat([latent, row[528:].view(torch.bfloat16).double()])
    if kv_cache.dtype == torch.float8_e4m3fn:
        return row.double() * float(kv_scale)
    return row.double()


def naive_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, kv_scale, sparse_indices=None):
    T, H, L = q_nope.shape
    B = block_table.shape[0]
    Q = T // B
    page_size = kv_cache.shape[1]
    out = torch.zeros(T, H, L, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for row in range(T):
        b, j = divmod(row, Q)
        if sparse_indices is None:
            last = int(seq_lens[b]) - Q + j
            slots = [int(block_table[b, t // page_size]) * page_size + t % page_size for t in range(last + 1)]
        else:
            slots = [int(s) for s in sparse_indices[row] if int(s) >= 0]
        if not slots:
            continue
        keys = torch.stack([token_row(kv_cache, s, kv_scale) for s in slots])  # [S, L+R]
        q = torch.cat([q_nope[row].double(), q_pe[row].double()], dim=-1)  # [H, L+R]
        logits = q @ keys.T * softmax_scale
        lse[row] = torch.logsumexp(logits, dim=-1)
        out[row] = torch.softmax(logits, dim=-1) @ keys[:, :L]
    return out, lse
