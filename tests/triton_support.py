"""Whether Triton kernels can run in this test session, for tests that run them on CPU tensors too.

With a GPU they compile natively. Without one they run in Triton's interpreter, which tests/conftest.py
selects (TRITON_INTERPRET=1) before anything imports triton. Triton 3.6's interpreter stops on our
kernels (numpy "only 0-dimensional arrays can be converted to Python scalars", seen with torch 2.11 on
the GPU machine with CUDA hidden); 3.8's (torch 2.14.1) and 3.9's (CI's) run them. Without triton
(a CPU machine needs none: ``pip install triton`` runs these tests in the interpreter) they are skipped.
"""

import pytest
import torch

try:
    import triton
except ImportError:
    triton = None

HAS_CUDA = torch.cuda.is_available()
FOUND = f"triton {triton.__version__}" if triton else "no triton (pip install triton)"
INTERPRETER_OK = triton is not None and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


def interpreter_active() -> bool:
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.max, InterpretedFunction)


TRITON_ON_CPU = interpreter_active() and INTERPRETER_OK  # the interpreter, on CPU tensors
TRITON_RUNS = HAS_CUDA or TRITON_ON_CPU
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"  # where a test gated by needs_triton runs its kernels
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU, or Triton >= 3.8's interpreter with "
                                  "TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py does); "
                                  f"found {FOUND}")
needs_triton_on_cpu = pytest.mark.skipif(not TRITON_ON_CPU, reason="runs Triton on CPU tensors: needs Triton >= 3.8's "
                                         "interpreter, which tests/conftest.py selects only without a GPU; found "
                                         f"{FOUND}, CUDA {'visible' if HAS_CUDA else 'absent'}")
