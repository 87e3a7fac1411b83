import os
import tempfile
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter, which is chosen when @triton.jit runs:
# set it before any test module imports triton (the Inductor CPU path does not use Triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis keeps its example database and caches in ./.hypothesis unless told otherwise: not in the tree.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "mla_inductor_hypothesis"))

import pytest  # noqa: E402
import tempfile  # noqa: E402

# The tests check the selection table's choices: measured selection only where a test turns it on (on a GPU with
# library versions outside the tested ranges it would be on by default), its results never in the user's cache.
os.environ.setdefault("MLA_INDUCTOR_AUTOTUNE", "0")
os.environ.setdefault("MLA_INDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mla_inductor_tests_"))

ROOT = Path(__file__).resolve().parent.parent
_TREE_BEFORE = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    # The slow tests first (a stable sort): pytest-xdist hands tests out in this order, so the longest ones
    # start at once rather than last, where one worker would run them alone while the others wait.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # pytest-xdist's "load" (what -n alone picks) sends each worker a block of consecutive tests up front: one
    # worker would get every slow test sorted first above. Work stealing starts the same way and hands an idle
    # worker the tail of a busy one's queue, so the workers finish together.
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


def tree_files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time; Python's ``__pycache__``, ``.git``
    and virtual environments (a folder holding ``pyvenv.cfg``) left out. Whatever an install left in the
    tree (``*.egg-info``, ``build/``) is in it as found, so that only what the tests write differs."""
    files = {}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("__pycache__", ".git")
                         and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))]
        for name in names:
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # removed while we walked
                continue
            files[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return files


def written_into(before: dict, after: dict) -> list[str]:
    """The files that appeared, changed or vanished between two ``tree_files`` snapshots."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def pytest_sessionstart(session):
    # One snapshot by the process that runs the session (with pytest-xdist, the controller, before any worker
    # starts): the suite writes into tmp_path and temporary folders only, never into the source tree.
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_TREE_BEFORE] = tree_files(ROOT)


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_TREE_BEFORE, None)
    if before is None:
        return
    written = written_into(before, tree_files(ROOT))
    if written:
        shown = ", ".join(written[:20]) + (f" and {len(written) - 20} more" if len(written) > 20 else "")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test session wrote into the source tree {ROOT}: {shown}"
        if reporter is not None:
            reporter.write_line(f"FAILED {message}", red=True, bold=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

