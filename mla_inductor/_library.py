"""Defining the package's ops with the low-level Library API.

The dispatcher then calls the Python implementation directly. ``torch.library.custom_op`` would add Python
layers on every call (its autograd wrapper, the output alias checks), which cost several times the dispatch
itself: these ops run once per layer and step, eagerly or from compiled code. No autograd formula:
inference only.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}
# Ops whose implementation compiled code may call itself (``define_op(direct=True)``), and who wants to know.
_DIRECT_IMPLS: dict = {}  # OpOverload -> impl
_DIRECT_WATCHERS: list[Callable] = []


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable, tags: tuple = (), *, direct: bool = False):
    """Define the op ``qualname`` ("namespace::name") with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor x) -> Tensor"``), computed by ``impl`` and faked by ``fake``; its OpOverloadPacket.

    ``direct``: code compiled by Inductor may call ``impl`` itself, without the dispatcher (the pass arranges it,
    ``watch_direct_ops``): the dispatcher's part of a call (its argument parsing, the autograd fallback, handing
    the arguments back to Python) was more than half of a no-op op's host cost per compiled call (7.7 -> 3.2
    µs on CPU, ``benchmarks/bench_host_overhead.py --stub``), as much as a short decode kernel's host work. Only
    for ops whose implementation takes the schema's arguments (positionally, or a defaulted one by name) and needs
    nothing the dispatcher adds (they have no autograd, and run under the device guard the compiled code sets)."""
    namespace, name = qualname.split("::")
    lib = _LIBRARIES.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    packet = getattr(getattr(torch.ops, namespace), name)
    if direct:
        _DIRECT_IMPLS[packet.default] = impl
        for watch in _DIRECT_WATCHERS:
            watch(packet.default, impl)
    return packet


def direct_ops_watched() -> bool:
    """Whether something (the Inductor pass) arranges direct calls for the ``direct=True`` ops: part of what
    decides the code Inductor generates, so of the pass's cache key."""
    return bool(_DIRECT_WATCHERS)


def watch_direct_ops(callback: Callable) -> None:
    """Call ``callback(op, impl)`` for every op defined with ``direct=True``: those defined so far, at once,
    and each later one as it is defined."""
    _DIRECT_WATCHERS.append(callback)
    for op, impl in list(_DIRECT_IMPLS.items()):
        callback(op, impl)
