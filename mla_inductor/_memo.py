"""``Memo``: what the runtime works out once per call signature (eager calls' decisions, prepared kernel
launches, FlashInfer wrapper keys), kept in a dict that starts over when it reaches its bound.

A program has a handful of signatures; the bound only matters for one that makes new ones without end (a
softmax_scale that changes every call, say). Starting over then costs one re-make per live signature; an LRU
would cost bookkeeping on every hit, and hits are the hot path (``memo.get(key)`` is dict's own lookup).

Each user keeps one module-level memo (eager calls in ``ops``, prepared launches in ``backends.triton``, small
kernel launches in ``kernels.launch``, wrapper keys in ``backends._flashinfer_common``): what is memoized follows
from the call signature alone, which is the key, so every caller of a kind shares one; per-step state (plans)
lives in objects of its own (``backends._common.PlanCache``).
"""

from __future__ import annotations

from typing import Any, Hashable


class Memo(dict):
    """A dict of values made once per key that empties itself before exceeding ``limit`` entries."""

    __slots__ = ("limit",)

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` under ``key`` (emptying the memo first if it is full) and return it."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
