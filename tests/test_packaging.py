"""What a build ships, what the package needs, and that a test session writes nothing into the source tree."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the README tells people to run besides the package: the sdist must hold these folders.
SHIPPED_FOLDERS = ("examples", "benchmarks", "tests", "docs")


def _source_files() -> list[str]:
    """The tree's source files: what git tracks (plus untracked, not ignored files) in a git checkout; every
    file but Python's caches in an unpacked sdist."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return [name for name in listed.stdout.splitlines() if (ROOT / name).is_file()]
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".egg-info")]


def _build(hook: str, source: Path, out: Path) -> str:
    """Run setuptools' PEP 517 ``hook`` (what ``python -m build --no-isolation`` runs) in ``source``; the built
    file's path. The hook's own output must warn about nothing."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # it makes setuptools warn
    result = subprocess.run([sys.executable, "-c", f"import sys, setuptools.build_meta as b; "
                             f"print(b.{hook}(sys.argv[1]))", str(out)], cwd=source, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in (result.stdout + result.stderr).splitlines() if "warn" in line.lower()]
    assert not warned, "\n".join(warned)
    return str(out / result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sdist_and_its_wheel_ship_what_they_should(tmp_path):
    pytest.importorskip("setuptools", minversion="77", reason="building needs setuptools>=77 (the [test] extra)")
    source = tmp_path / "src"
    files = _source_files()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)

    sdist = _build("build_sdist", source, tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = [name for name in files if name.split("/")[0] in SHIPPED_FOLDERS and name not in shipped]
    assert not missing, f"the sdist leaves out what the README runs: {missing}"
    assert "LICENSE" in shipped and not [name for name in shipped if "__pycache__" in name]

    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = _build("build_wheel", unpacked, tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "mla_inductor/py.typed" in names and any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert {"Homepage", "Documentation", "Issues"} <= set(re.findall(r"^Project-URL: (\w+),", metadata, re.M))
    # torch's CUDA builds bring the triton they need; a CPU install downloads none.
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert not [r for r in requires if r.startswith("triton")], requires
    assert any(r.startswith("pytest-xdist") and 'extra == "test"' in r for r in requires), requires

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
                   check=True, capture_output=True)
    code = ("import mla_inductor, mla_inductor.lowering, mla_inductor.kernels, torch\n"
            "assert mla_inductor.__file__.startswith(%r), mla_inductor.__file__\n"
            "assert mla_inductor.lowering.installed_pass() is not None\n"
            "assert hasattr(torch.ops.mla, 'paged_decode_with_lse')\n"
            "print('ok')\n") % str(target)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.slow
def test_a_session_that_writes_into_the_source_tree_fails(tmp_path):
    """tests/conftest.py compares the tree's files before and after the session (with pytest-xdist, in the
    controller): a test writing into the tree fails the session and is named; tmp_path, and whatever was in
    the tree before (an install's ``*.egg-info`` or ``build/``), are not."""
    tree, tests = tmp_path / "tree", tmp_path / "tree" / "tests"
    tests.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "conftest.py", tests)
    shutil.copy(ROOT / "pyproject.toml", tree)
    (tree / "build").mkdir()
    (tree / "build" / "left_by_pip_install.txt").write_text("before the session")
    (tests / "test_writes.py").write_text(
        "from pathlib import Path\n\n"
        "def test_into_tmp_path(tmp_path):\n    (tmp_path / 'fine.txt').write_text('x')\n\n"
        "def test_into_the_tree():\n    (Path(__file__).parent / 'written.txt').write_text('x')\n")
    workers = ["-n", "1"] if importlib.util.find_spec("xdist") else []  # the README's command runs xdist
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", *workers, "--basetemp", str(tmp_path / "base"),
                             "tests"], cwd=tree, capture_output=True, text=True)
    out = result.stdout
    assert result.returncode == pytest.ExitCode.TESTS_FAILED and "2 passed" in out, out[-3000:]
    assert "wrote into the source tree" in out and os.path.join("tests", "written.txt") in out, out[-3000:]
    assert "fine.txt" not in out and "left_by_pip_install" not in out, out[-3000:]


# The package's CPU path without triton installed: every import of it fails, as on a machine that never
# installed it (triton is no dependency of ours; torch's CUDA builds bring it).
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ModuleNotFoundError, importlib.util.find_spec finds nothing
import torch
import mla_inductor, mla_inductor.lowering
from mla_inductor.reference import paged_decode_reference
from mla_inductor.testing import make_decode_inputs, relative_error

x = make_decode_inputs([5, 70], num_heads=4, kv_lora_rank=32, rope_dim=16, page_size=16, fmt="bf16")
expected, _ = paged_decode_reference(*x.args()[:7])
eager = torch.ops.mla.paged_decode(*x.args()[:7])
out, lse = torch.ops.mla.paged_decode_with_lse(*x.args()[:7])
compiled = torch.compile(lambda *a: torch.ops.mla.paged_decode(*a), fullgraph=True)(*x.args()[:7])
merged, _ = torch.ops.mla.merge_attn_states(out, lse, out, lse)
for name, got in (("eager", eager), ("with_lse", out), ("compiled", compiled), ("merged", merged)):
    assert relative_error(got, expected) < 1e-2, (name, relative_error(got, expected))
kv = torch.randn(2, 48, dtype=torch.bfloat16)
torch.ops.mla.cache_append(x.kv_cache, kv[:, :32], kv[:, 32:], torch.tensor([0, 17]), x.kv_scale)
assert torch.equal(x.kv_cache[0, 0], kv[0]) and torch.equal(x.kv_cache[1, 1], kv[1])
assert sys.modules["triton"] is None
print("ok")
"""


@pytest.mark.slow
def test_cpu_path_runs_without_triton(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
