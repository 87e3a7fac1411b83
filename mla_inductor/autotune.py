"""Optional compile-time autotuning: time every eligible backend on the call's real shapes, keep the winner.

Enabled with ``MLA_INDUCTOR_AUTOTUNE=1`` (or ``autotuning(True)``). The selection table is measured
on one GPU; autotuning re-measures on yours. Inputs are random with every sequence at the block
table's full length (the decode step the compiled graph will mostly see); winners are cached per
(problem, sizes, device) for the life of the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Optional

import torch

from mla_inductor.cache import encode_tokens, fp8_scale_for
from mla_inductor.contract import DecodeProblem

AUTOTUNE_ENV = "MLA_INDUCTOR_AUTOTUNE"
_local = threading.local()
_winners: dict = {}


def autotune_enabled() -> bool:
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced
    return os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0")


@contextlib.contextmanager
def autotuning(enabled: bool = True) -> Iterator[None]:
    """Turn compile-time autotuning on (or off) inside the block, whatever ``$MLA_INDUCTOR_AUTOTUNE`` says."""
    previous = getattr(_local, "forced", None)
    _local.forced = enabled
    try:
        yield
    finally:
        _local.forced = previous


def _timing_inputs(problem: DecodeProblem, sizes: dict, device: torch.device) -> tuple:
    """The eight arguments of a call of these sizes: random values, every sequence at the block table's full
    length (pages in order), sparse rows listing random slots of their sequence."""
    B, max_pages, num_pages = sizes["batch"], sizes["max_pages"], sizes["num_pages"]
    page, L, R, H = problem.page_size, problem.kv_lora_rank, problem.rope_dim, problem.num_heads
    T = B * (problem.q_per_seq or 1)
    num_pages = max(num_pages, B * max_pages)
    values = torch.randn(num_pages, page, L + R, device=device)
    kv_scale = fp8_scale_for(values) if problem.cache_format == "fp8_e4m3" else torch.ones(1, device=device)
    kv_cache = encode_tokens(values, problem.cache_format, kv_scale)
    block_table = torch.arange(B * max_pages, dtype=torch.int32, device=device).view(B, max_pages)
    seq_lens = torch.full((B,), max_pages * page, dtype=torch.int32, device=device)
    q_nope = (torch.randn(T, H, L, device=device) * 0.5).to(problem.q_dtype)
    q_pe = (torch.randn(T, H, R, device=device) * 0.5).to(problem.q_dtype)
    sparse = None
    if problem.sparse:
        seq = torch.arange(T, device=device) // (problem.q_per_seq or 1)
        offsets = torch.randint(0, max_pages * page, (T, problem.topk), device=device)
        sparse = (seq[:, None] * max_pages * page + offsets).to(torch.int32)
    return q_nope, q_pe, kv_cache, block_table, seq_lens, (L + R) ** -0.5, kv_scale, sparse


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def fastest_backend(problem: DecodeProblem, capability, candidates: list[str], sizes: dict,
                    device: torch.device, timer=_median_ms) -> Optional[str]:
    """The candidate with the lowest ``timer`` (median ms of a call) on random inputs of these sizes
    (None if none ran)."""
    key = (problem, capability, tuple(candidates), tuple(sorted(sizes.items())), str(device))
    if key in _winners:
        return _winners[key]
    from mla_inductor.backends import get_backend

    x = _timing_inputs(problem, sizes, device)
    times = {}
    for name in candidates:
        backend = get_backend(name)
        try:
            times[name] = timer(lambda: backend.decode(*x))
        except Exception:  # noqa: BLE001 - a backend that fails here is simply not the winner
            continue
    winner = min(times, key=times.get) if times else None
    _winners[key] = winner
    return winner
