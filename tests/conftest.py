import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter, which is chosen when @triton.jit runs:
# set it before any test module imports triton (the Inductor CPU path does not use Triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import tempfile  # noqa: E402

# The tests check the selection table's choices: measured selection only where a test turns it on (on a GPU with
# library versions outside the tested ranges it would be on by default), its results never in the user's cache.
os.environ.setdefault("MLA_INDUCTOR_AUTOTUNE", "0")
os.environ.setdefault("MLA_INDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mla_inductor_tests_"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
