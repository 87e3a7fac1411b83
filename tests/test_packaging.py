"""A wheel (not only the editable install) ships lowering/ as mla_inductor.lowering and the kernels."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tracked_sources(dest: Path) -> None:
    """Copy what git tracks (plus untracked, not ignored files) into ``dest``: the build writes its
    build/ and *.egg-info there, never into the source tree."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def test_wheel_installs_both_halves(tmp_path):
    source, wheel_dir, target = tmp_path / "src", tmp_path / "wheel", tmp_path / "site"
    before = sorted(p.name for p in ROOT.iterdir())
    _tracked_sources(source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(wheel_dir)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("mla_inductor-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import mla_inductor, mla_inductor.lowering, mla_inductor.kernels, torch\n"
            "assert mla_inductor.__file__.startswith(%r), mla_inductor.__file__\n"
            "assert mla_inductor.lowering.installed_pass() is not None\n"
            "assert hasattr(torch.ops.mla, 'paged_decode_with_lse')\n"
            "print('ok')\n") % str(target)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "ok", result.stderr[-3000:]
    assert sorted(p.name for p in ROOT.iterdir()) == before, "the build wrote into the source tree"
    assert not list(ROOT.glob("*.egg-info")) and not (ROOT / "build").exists()
