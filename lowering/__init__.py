"""The Inductor side of mla-inductor, installed as ``mla_inductor.lowering``.

``MLALoweringPass`` is Inductor's post-grad custom pass: every ``torch.compile`` rewrites
``mla.paged_decode`` calls into the selected backend. ``import mla_inductor`` arranges for this module to
be imported on the first compile that reaches Inductor; importing it installs the pass at once.
``install()``/``uninstall()`` do it by hand; a post-grad pass the user had installed keeps running, before
ours.
"""

from mla_inductor.lowering.graph_pass import MLALoweringPass, install, installed_pass, uninstall
from mla_inductor.lowering.records import Decision, decisions, decisions_made

install()

__all__ = ["Decision", "MLALoweringPass", "decisions", "decisions_made", "install", "installed_pass", "uninstall"]
