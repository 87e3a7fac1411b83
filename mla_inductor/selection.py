"""Which backend runs a call: a table of preferences per device, filtered by what each backend supports.

``select_backend`` is a pure function of the call's ``DecodeProblem``, the device's compute capability,
what is installed and the user's preference; the Inductor pass and the eager path both ask it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

from mla_inductor.contract import DecodeProblem

BACKEND_ENV = "MLA_INDUCTOR_BACKEND"
_local = threading.local()


@dataclass(frozen=True)
class Selection:
    backend: str
    reasons: tuple[str, ...]  # why each backend ahead of the winner was passed over


def table_order(problem: DecodeProblem, capability: Optional[tuple[int, int]]) -> list[str]:
    """Backends to try, best first, for this device and problem."""
    if problem.device_type != "cuda" or capability is None:
        return ["reference"]
    return ["reference"]


def user_preference() -> Optional[tuple[str, ...]]:
    """The user's backend priority list: ``prefer_backends(...)`` if active, else ``$MLA_INDUCTOR_BACKEND``
    (comma-separated), else None (use the table)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get(BACKEND_ENV, "").strip()
    return tuple(n.strip() for n in env.split(",") if n.strip()) or None


@contextlib.contextmanager
def prefer_backends(*names: str) -> Iterator[None]:
    """Use these backends, in this order, for calls made (eager) or compiled inside the block."""
    from mla_inductor.backends import BACKEND_MODULES

    unknown = [n for n in names if n not in BACKEND_MODULES]
    if unknown or not names:
        raise ValueError(f"prefer_backends needs known backend names, got {names}; known: {sorted(BACKEND_MODULES)}")
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(tuple(names))
    try:
        yield
    finally:
        stack.pop()


def select_backend(
    problem: DecodeProblem,
    capability: Optional[tuple[int, int]],
    *,
    available: Optional[Mapping[str, Optional[str]]] = None,
    preference: Optional[Sequence[str]] = None,
) -> Selection:
    """The first backend of the user's preference (or the table's order) that is available and supports
    the problem. ``available`` maps backend name -> None or why it is unavailable (default: probe the
    installed libraries). Raises RuntimeError, listing every reason, when none can run the call."""
    from mla_inductor.backends import BACKEND_MODULES, availability, get_backend

    available = availability() if available is None else available
    preference = user_preference() if preference is None else preference
    order = list(preference) if preference else table_order(problem, capability)
    reasons = []
    for name in order:
        if name not in BACKEND_MODULES:
            raise ValueError(f"unknown MLA backend {name!r} in the preference; known: {sorted(BACKEND_MODULES)}")
        why = available.get(name, "not installed")
        if why is None:
            why = get_backend(name).supports(problem, capability)
        if why is None:
            return Selection(name, tuple(reasons))
        reasons.append(f"{name}: {why}")
    raise RuntimeError(
        f"no MLA backend can run {problem} on capability {capability}: " + "; ".join(reasons)
    )
