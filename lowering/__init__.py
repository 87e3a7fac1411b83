"""The Inductor side of mla-inductor, installed as ``mla_inductor.lowering``.

``import mla_inductor.lowering`` registers the ops (through ``mla_inductor``) and installs
``MLALoweringPass`` as Inductor's post-grad custom pass, so every ``torch.compile`` that follows
rewrites ``mla.paged_decode`` calls into the selected backend. ``install()``/``uninstall()`` do it
by hand; a post-grad pass the user had installed keeps running, before ours.
"""

from mla_inductor.lowering.graph_pass import Decision, MLALoweringPass, decisions, install, installed_pass, uninstall

install()

__all__ = ["Decision", "MLALoweringPass", "decisions", "install", "installed_pass", "uninstall"]
