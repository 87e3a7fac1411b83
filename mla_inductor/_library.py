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


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable, tags: tuple = ()):
    """Define the op ``qualname`` ("namespace::name") with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor x) -> Tensor"``), computed by ``impl`` and faked by ``fake``; its OpOverloadPacket."""
    namespace, name = qualname.split("::")
    lib = _LIBRARIES.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    return getattr(getattr(torch.ops, namespace), name)
