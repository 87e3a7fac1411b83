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


def _timing_inputs(problem: DecodeProblem, sizes: dict, device: torch.device):
    from mla_inductor.testing import make_decode_inputs

    B, max_pages, num_pages = sizes["batch"], sizes["max_pages"], sizes["num_pages"]
    page = problem.page_size
    full = max_pages * page
    spare = max(0, num_pages - B * max_pages)
    return make_decode_inputs([full] * B, num_heads=problem.num_heads, q_per_seq=problem.q_per_seq or 1,
                              kv_lora_rank=problem.kv_lora_rank, rope_dim=problem.rope_dim, page_size=page,
                              fmt=problem.cache_format, q_dtype=problem.q_dtype, topk=problem.topk,
                              spare_pages=spare, device=device)


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
            times[name] = timer(lambda: backend.decode(*x.args()))
        except Exception:  # noqa: BLE001 - a backend that fails here is simply not the winner
            continue
    winner = min(times, key=times.get) if times else None
    _winners[key] = winner
    return winner
