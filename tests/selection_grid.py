"""The backend ``select_backend`` picks for a grid of calls, every library installed: the table's behaviour,
pinned in ``selection_picks.json`` (``python tests/selection_grid.py`` rewrites it after a deliberate change)."""

import itertools
import json
from pathlib import Path

from mla_inductor.backends import registered_backends
from mla_inductor.info import example_problem
from mla_inductor.selection import CallContext, select_backend

PICKS = Path(__file__).resolve().parent / "selection_picks.json"
CAPABILITIES = {"cpu": None, "sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
FORMATS = ("bf16", "fp8_e4m3", "fp8_ds_mla", "fp32")
# One letter per backend, so that a line holds the picks of every (H, B) of a group ("-": none can run the call).
CODES = {"reference": "r", "triton": "t", "flashmla": "m", "flashinfer_fa3": "3", "flashinfer_fa2": "2",
         "flashinfer_trtllm": "g", "flashinfer_xqa": "x"}
CONTEXTS = {"eager": None, "one-call": CallContext(1), "one-call-captured": CallContext(1, captured=True),
            "step": CallContext(61), "step-captured": CallContext(61, captured=True)}
HEADS = (16, 32, 64, 65, 128)
BATCHES = (None, 1, 2, 8, 9, 16, 17, 32, 33, 128)


def grid_picks() -> dict[str, str]:
    """{"device fmt dense|sparse q=bf16|e4m3 page=P context": the code (``CODES``) of the backend picked for each
    (H, B) of HEADS x BATCHES, H-major}."""
    everything = {name: None for name in registered_backends()}
    picks = {}
    for (dev, cap), fmt, sparse, fp8_query, page, (where, context) in itertools.product(
            CAPABILITIES.items(), FORMATS, (False, True), (False, True), (64, 1), CONTEXTS.items()):
        names = []
        for heads, batch in itertools.product(HEADS, BATCHES):
            problem = example_problem("cpu" if cap is None else "cuda", fmt, sparse, heads, page, batch=batch,
                                      fp8_query=fp8_query)
            try:
                name = select_backend(problem, cap, available=everything, preference=(), context=context).backend
                names.append(CODES.get(name, name))
            except RuntimeError:
                names.append("-")
        key = (f"{dev} {fmt} {'sparse' if sparse else 'dense'} q={'e4m3' if fp8_query else 'bf16'} page={page} "
               f"{where}")
        picks[key] = "".join(names)
    return picks


if __name__ == "__main__":
    PICKS.write_text(json.dumps(grid_picks(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {PICKS}")
