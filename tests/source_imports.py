"""What a source file imports, read from its syntax tree (a comment or string naming a module is no import)."""

import ast
from pathlib import Path


def imported_modules(path: Path) -> set[str]:
    """Every absolute import of ``path``: ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and
    ``a.b`` (b may be a module or a name in a). Relative imports are left out."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names
