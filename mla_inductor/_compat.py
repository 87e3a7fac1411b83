"""The one runtime module that names private or prototype torch APIs (the Inductor ones live in
``lowering/_compat.py``). Each entry says what it is for and which torch releases it was checked on."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def while_loop(cond_fn: Callable, body_fn: Callable, carried: Sequence[torch.Tensor],
               additional: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``torch.ops.higher_order.while_loop`` (prototype control flow, torch 2.11 to 2.14).

    Eager: a Python loop calling ``body_fn(*carried, *additional)`` while ``cond_fn`` (a 0-d bool
    tensor) holds. Traced (make_fx, the Inductor pass): one ``while_loop`` node whose subgraphs Inductor
    generates as kernels run in a loop, so the loop's memory is that of one iteration. The functions
    must not close over tensors (pass them in ``additional``) and must return carries of unchanged
    shape, dtype and strides.
    """
    return torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(carried), tuple(additional))
