"""The only place the pass names Inductor's private APIs (they move between torch releases; we support
2.11 through 2.14). The runtime's private torch APIs are fenced in ``mla_inductor/_compat.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch._inductor.config as inductor_config
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_int, statically_known_true
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, register_graph_pattern

from mla_inductor._library import StaticTensor, call_site_facts, call_site_name

__all__ = ["CustomGraphPass", "Match", "as_pass_list", "call_without_dispatcher", "cudagraph_trees_enabled",
           "cudagraphs_enabled", "current_post_grad_pass", "decide", "direct_calls_supported", "functionalized_target",
           "keep_in_graph", "pattern_pass", "set_post_grad_pass", "size_hint", "size_key", "specialize",
           "static_size"]


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


def cudagraphs_enabled() -> bool:
    """Whether the graph being compiled will be captured in CUDA graphs (``mode="reduce-overhead"`` sets this
    Inductor option for the compile it runs)."""
    return bool(inductor_config.triton.cudagraphs)


def cudagraph_trees_enabled() -> bool:
    """Whether CUDA graphs are made by CUDA-graph trees (the default) rather than Inductor's older one-graph
    path (``triton.cudagraph_trees=False``)."""
    return bool(getattr(inductor_config.triton, "cudagraph_trees", True))


def functionalized_target(node: torch.fx.Node) -> Any:
    """The op an ``auto_functionalized`` / ``auto_functionalized_v2`` node of a post-grad graph stands for (a
    mutating op, functionalized; its writes reach the graph's inputs through ``copy_`` nodes), else None."""
    higher_order = torch.ops.higher_order
    kinds = tuple(getattr(higher_order, name) for name in ("auto_functionalized", "auto_functionalized_v2")
                  if hasattr(higher_order, name))
    if node.op == "call_function" and node.target in kinds and node.args:
        return node.args[0]
    return None


# ----------------------------------------------------------------------------- symbolic sizes
# Sizes of the fake tensors the pass reads are ints or SymInts of the graph's ShapeEnv (dynamic shapes).
# "Backed" SymInts have an example value (the size the graph was traced with); unbacked ones
# (``mark_unbacked``, data-dependent sizes) have none and cannot be guarded on.


def static_size(size) -> Optional[int]:
    """The size as an int if it is one, or a SymInt whose value is fixed (e.g. by an earlier guard); else None."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    return int(expr) if expr.is_number else None


def size_key(size) -> Any:
    """A hashable stand-in for a size: the int, or a SymInt's expression (equal sizes, equal keys)."""
    return size if isinstance(size, int) else size.node.expr


def size_hint(size) -> Optional[int]:
    """A size's value, or for a backed SymInt the value it was traced with; None when unbacked."""
    if isinstance(size, int):
        return size
    return size.node.hint if size.node.has_hint() else None


def specialize(size) -> Optional[int]:
    """Fix a backed symbolic size to the value it was traced with: a guard, so a call with another value
    recompiles (the graph is then compiled for that one). Returns the value, or None for an unbacked size
    (left symbolic: it has no value to guard on)."""
    if size_hint(size) is None:
        return None
    return guard_int(size)


def decide(cond) -> Optional[bool]:
    """A symbolic condition's value where it is known, or for backed sizes the value it has for the traced
    sizes, kept as a guard (a call for which it differs recompiles); None where it depends on an unbacked
    size."""
    if isinstance(cond, bool):
        return cond
    if statically_known_true(cond):
        return True
    if statically_known_true(torch.sym_not(cond)):
        return False
    if free_unbacked_symbols(cond):
        return None
    return bool(cond)  # evaluates for the traced sizes and records the guard


def keep_in_graph(op) -> None:
    """Mark an op that returns nothing as having a side effect, so neither FX's nor Inductor's dead-code
    elimination drops it (``torch.fx.node.has_side_effect``; Inductor's fallback kernels ask the same
    registry, torch 2.11 to 2.14)."""
    from torch.fx.node import has_side_effect

    has_side_effect(op)


# ----------------------------------------------------------------------------- calls without the dispatcher

class _Namespace:
    """``extern_kernels.mla_direct.<namespace>.<op>.<overload>``: the generated code names the op it calls.

    At the op's level, ``site_<overload>_<code>`` is a call site's own callable (``_library.define_op``'s
    ``call_site``), made where it is first named: code Inductor loads from its cache in a new process names
    sites this process never lowered; ``code`` holds their facts (``_library.call_site_name``). Where this
    process has no ``call_site`` for the op (one that arranged its calls without them), a site is the op's
    implementation, which computes the same."""

    def __getattr__(self, name: str):
        overload, _, code = name.removeprefix("site_").rpartition("_")
        impl = self.__dict__.get(overload) if name.startswith("site_") else None
        if impl is None:
            raise AttributeError(name)
        call_site = self.__dict__.get("_call_sites", {}).get(overload, (impl, None))[1]
        site = (call_site(call_site_facts(code)) if call_site is not None else None) or impl
        setattr(self, name, site)  # later lookups find it in the instance's __dict__
        return site


DIRECT_ROOT = "mla_direct"


def _direct_call_parts() -> Optional[tuple]:
    """What ``call_without_dispatcher`` takes from Inductor, or None where this torch lacks some of it."""
    try:
        from torch._inductor import ir
        from torch._inductor import lowering as inductor_lowering
        from torch._inductor.select_algorithm import extern_kernels
        from torch._inductor.virtualized import V
    except ImportError:
        return None
    needed = [getattr(ir, "FallbackKernel", None)] + [getattr(inductor_lowering, name, None) for name in (
        "make_fallback", "lowerings", "tag_to_layout_constraint", "get_layout_constraint_tag")]
    return None if any(n is None for n in needed) else (ir, inductor_lowering, extern_kernels, V)


def direct_calls_supported() -> bool:
    """Whether this torch's Inductor lets compiled code call an op's implementation (``call_without_dispatcher``)."""
    return _direct_call_parts() is not None


def call_without_dispatcher(op: torch._ops.OpOverload, impl: Callable,
                            call_site: Optional[Callable] = None) -> Optional[str]:
    """Make Inductor's Python wrapper code call ``impl`` where it would call ``op`` through the dispatcher (its
    fallback kernel), and return the name the code calls it by; None where this torch's Inductor does not
    offer what it takes (the op then keeps the dispatcher).

    Inductor writes a fallback kernel's call as ``<python_kernel_name>(args)`` into code that imports
    ``torch._inductor.select_algorithm.extern_kernels`` (its namespace for kernels outside Inductor,
    ``ExternKernelChoice``). ``impl`` is put there as ``extern_kernels.mla_direct.<ns>.<op>.<overload>`` and
    the op gets Inductor's own fallback lowering (with the layout constraint Inductor gives a custom op by its
    tags), wrapped to rename the fallback kernels it makes. Not for the C++ / FX wrappers, which call ops
    their own way. Torch 2.11 to 2.14.

    With ``call_site`` (``_library.define_op``'s), a call whose arguments' sizes are all static calls
    ``extern_kernels.mla_direct.<ns>.<op>.site_<overload>_<code>`` instead: ``call_site(facts)``, made once per
    site (``_Namespace``), where that returns a callable."""
    parts = _direct_call_parts()
    if parts is None:
        return None
    ir, inductor_lowering, extern_kernels, V = parts
    constraint = inductor_lowering.tag_to_layout_constraint(
        inductor_lowering.get_layout_constraint_tag(op, with_default=True))
    fallback_kernel = ir.FallbackKernel
    namespace, name = op._schema.name.split("::")
    node = extern_kernels
    for part in (DIRECT_ROOT, namespace, name):
        if not isinstance(getattr(node, part, None), _Namespace):
            setattr(node, part, _Namespace())
        node = getattr(node, part)
    overload = op._overloadname
    setattr(node, overload, impl)
    if call_site is not None:
        node.__dict__.setdefault("_call_sites", {})[overload] = (impl, call_site)
    op_path = f"extern_kernels.{DIRECT_ROOT}.{namespace}.{name}"
    kernel_name = f"{op_path}.{overload}"
    lowerings = inductor_lowering.lowerings
    if getattr(lowerings.get(op), "_mla_direct_call", None) == kernel_name:
        return kernel_name
    if op not in lowerings:
        inductor_lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    fallback = lowerings[op]

    def lowering(*args, **kwargs):
        graph = V.graph
        made = getattr(graph, "operations", graph.buffers)
        first = len(made)
        result = fallback(*args, **kwargs)
        if not graph.cpp_wrapper and not getattr(graph, "fx_wrapper", False):
            site = _site_name(node, overload, call_site, op, args, kwargs) if call_site is not None else None
            for kernel in made[first:]:
                if isinstance(kernel, fallback_kernel) and kernel.op_overload is op:
                    kernel.python_kernel_name = f"{op_path}.{site}" if site else kernel_name
        return result

    functools.update_wrapper(lowering, fallback)
    lowering._mla_direct_call = kernel_name
    lowerings[op] = lowering
    return kernel_name


def _site_name(node: _Namespace, overload: str, call_site: Callable, op, args, kwargs) -> Optional[str]:
    """The attribute of ``node`` naming this call's site, made now; None where a size is symbolic or
    ``call_site`` keeps the op's implementation for these facts."""
    facts = _static_facts(op, args, kwargs)
    if facts is None:
        return None
    name = f"site_{overload}_{call_site_name(facts)}"
    site = call_site(facts)
    if site is None:
        return None
    setattr(node, name, site)
    return name


def _static_facts(op, args, kwargs) -> Optional[tuple]:
    """The lowering's arguments of ``op`` in schema order as ``_library.call_site``'s facts, or None where one is
    not static (a symbolic size or scalar)."""
    facts = []
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            value = argument.default_value if argument.has_default_value() else None
        fact = _static_fact(value)
        if fact is _NOT_STATIC:
            return None
        facts.append(fact)
    return tuple(facts)


_NOT_STATIC = object()


def _static_fact(value) -> Any:
    from torch._inductor import ir

    if isinstance(value, ir.IRNode):
        shape = tuple(_number(s) for s in value.get_size())
        if None in shape:
            return _NOT_STATIC
        return StaticTensor(value.get_dtype(), value.get_device(), shape)
    if isinstance(value, (list, tuple)):
        facts = [_static_fact(v) for v in value]
        return _NOT_STATIC if any(f is _NOT_STATIC for f in facts) else facts
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_STATIC  # (a site's name holds its facts as Python literals: inf and nan are not ones)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    return _NOT_STATIC


def _number(size) -> Optional[int]:
    """An IR size (an int or a sympy expression) as an int where it is a number, else None."""
    if isinstance(size, int):
        return size
    return int(size) if getattr(size, "is_number", False) else None
