"""Whether Triton kernels can run in this test session, for tests that run them on CPU tensors too.

With a GPU they compile natively. Without one they run in Triton's interpreter, which tests/conftest.py
selects (TRITON_INTERPRET=1) before anything imports triton. Triton 3.6's interpreter stops on our
kernels (numpy "only 0-dimensional arrays can be converted to Python scalars", seen with torch 2.11 on
the GPU machine with CUDA hidden); 3.8's (torch 2.14.1) and 3.9's (CI's) run them.
"""

import pytest
import torch
import triton

HAS_CUDA = torch.cuda.is_available()
INTERPRETER_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


def interpreter_active() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.max, InterpretedFunction)


TRITON_RUNS = HAS_CUDA or (interpreter_active() and INTERPRETER_OK)
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs a GPU, or Triton >= 3.8's interpreter with "
                                  "TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py does); "
                                  f"found triton {triton.__version__}")
