"""The only place the pass names Inductor's private APIs (they move between torch releases; we support
2.11 through 2.14). The runtime's private torch APIs are fenced in ``mla_inductor/_compat.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, register_graph_pattern

__all__ = ["CustomGraphPass", "Match", "as_pass_list", "current_post_grad_pass", "keep_in_graph", "pattern_pass",
           "set_post_grad_pass"]


def current_post_grad_pass() -> Any:
    """``torch._inductor.config.post_grad_custom_post_pass``: None, a pass, or (torch >= 2.13) a list."""
    return inductor_config.post_grad_custom_post_pass


def set_post_grad_pass(value: Any) -> None:
    inductor_config.post_grad_custom_post_pass = value


def as_pass_list(value: Any) -> list:
    """The passes a post-grad pass setting holds: torch 2.13 also accepts a list there, 2.11 exactly one."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def pattern_pass(name: str, ops: Iterable, handler: Callable[..., None]) -> PatternMatcherPass:
    """A pattern-matcher pass calling ``handler(match, *args, **kwargs)`` for every call of ``ops``;
    the handler replaces the node with ``match.replace_by_example(fn, args)``."""
    patterns = PatternMatcherPass(pass_name=name)
    for op in ops:
        register_graph_pattern(CallFunctionVarArgs(op), pass_dict=patterns)(handler)
    return patterns


def keep_in_graph(op) -> None:
    """Mark an op that returns nothing as having a side effect, so neither FX's nor Inductor's dead-code
    elimination drops it (``torch.fx.node.has_side_effect``; Inductor's fallback kernels ask the same
    registry, torch 2.11 to 2.14)."""
    from torch.fx.node import has_side_effect

    has_side_effect(op)
