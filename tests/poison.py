"""Hostile but valid decode inputs, as the peers' own tests build them.

FlashMLA's and SGLang's decode tests fill every cache row a call does not attend (pages past a sequence's
last, the tail of its last page) with NaN and the unused block-table entries with 2147480000; FlashMLA's
sparse tests fill every slot no row lists with NaN; vLLM's CPU MLA test fills the tails with NaN. Here
the same, for every cache format: NaN or inf values, the bytes NaN has in e4m3 (0x7F / 0xFF, what
``torch.empty`` may hold), all-ones fp8_ds_mla rows (NaN latent, NaN tile scales, NaN rope), or random
bytes. Whatever a correct kernel does with such a call, these rows never reach its output.
"""

from __future__ import annotations

import dataclasses

import torch

HUGE_PAGE_ID = 2147480000  # FlashMLA's / SGLang's filler for unused block-table entries
GARBAGE = ("nan", "inf", "bytes")


def attended_slots(kv_cache, block_table, seq_lens, q_per_seq, sparse_indices=None) -> torch.Tensor:
    """bool [P * page_size]: the flat slots some query row of the call attends (docs/contract.md)."""
    page_size = kv_cache.shape[1]
    capacity = kv_cache.shape[0] * page_size
    used = torch.zeros(capacity, dtype=torch.bool)
    if sparse_indices is not None:
        listed = sparse_indices.cpu().long().flatten()
        used[listed[listed >= 0]] = True
        return used
    for b in range(block_table.shape[0]):
        length = int(seq_lens[b])  # row b*Q + Q-1 attends positions 0..length-1
        for t in range(length):
            used[int(block_table[b, t // page_size]) * page_size + t % page_size] = True
    return used


def _garbage_rows(kv_cache: torch.Tensor, n: int, garbage: str, generator: torch.Generator) -> torch.Tensor:
    """n token rows of garbage in the cache's dtype and row width."""
    width = kv_cache.shape[-1]
    if garbage == "bytes":
        nbytes = width * kv_cache.element_size()
        raw = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=generator)
        return raw.view(kv_cache.dtype)
    if kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn):  # NaN bytes: 0xFF (e4m3 -NaN, fp32/bf16 NaN)
        byte = 0xFF if garbage == "nan" or kv_cache.dtype == torch.uint8 else 0x7F
        return torch.full((n, width), byte, dtype=torch.uint8).view(kv_cache.dtype)
    return torch.full((n, width), float(garbage), dtype=kv_cache.dtype)


def poison_unattended(kv_cache: torch.Tensor, used: torch.Tensor, garbage: str = "nan", seed: int = 0) -> None:
    """Overwrite, in place, every cache row whose flat slot is not in ``used`` with garbage."""
    page_size = kv_cache.shape[1]
    idle = (~used).nonzero().flatten()
    if idle.numel() == 0:
        return
    rows = _garbage_rows(kv_cache, idle.numel(), garbage, torch.Generator().manual_seed(seed))
    kv_cache[idle // page_size, idle % page_size] = rows.to(kv_cache.device)


def fill_unused_table_entries(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                              value: int = HUGE_PAGE_ID) -> None:
    """Entries past each sequence's last used page get ``value`` (in place)."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    unused = cols[None, :] * page_size >= seq_lens.long()[:, None]
    block_table.masked_fill_(unused, value)


def poisoned(x, garbage: str = "nan", table_fill: int = HUGE_PAGE_ID, seed: int = 0):
    """A copy of DecodeInputs ``x`` with every unattended cache row garbage and every unused
    block-table entry ``table_fill`` (None: left as is)."""
    x = dataclasses.replace(x, kv_cache=x.kv_cache.clone(), block_table=x.block_table.clone())
    q_per_seq = x.q_nope.shape[0] // max(x.block_table.shape[0], 1)
    used = attended_slots(x.kv_cache, x.block_table.cpu(), x.seq_lens.cpu(), q_per_seq, x.sparse_indices)
    poison_unattended(x.kv_cache, used, garbage, seed)
    if table_fill is not None:
        fill_unused_table_entries(x.block_table, x.seq_lens, x.kv_cache.shape[1], table_fill)
    return x
