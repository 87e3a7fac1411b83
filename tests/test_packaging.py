"""A wheel (not only the editable install) ships lowering/ as mla_inductor.lowering."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_both_halves(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(wheel_dir)], check=True, capture_output=True)
    wheel = next(wheel_dir.glob("mla_inductor-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import mla_inductor, mla_inductor.lowering, torch\n"
            "assert mla_inductor.__file__.startswith(%r), mla_inductor.__file__\n"
            "assert mla_inductor.lowering.installed_pass() is not None\n"
            "assert hasattr(torch.ops.mla, 'paged_decode_with_lse')\n"
            "print('ok')\n") % str(target)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "ok", result.stderr[-3000:]
