"""Loading a script of benchmarks/ in a test (the benchmarks are not a package)."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py``, registered in sys.modules (compiled code refers to its functions
    by module). The scripts import each other by name, as they do when run from benchmarks/: those imports are
    found there while the module loads."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.path.insert(0, str(BENCHMARKS))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            sys.path.remove(str(BENCHMARKS))
    return sys.modules[name]
