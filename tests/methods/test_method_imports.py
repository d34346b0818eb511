"""Methods compose parts from ``cache/``, ``quant/`` and ``kernels/`` and never import each other:
a module that registers a method may import only modules of ``kvbench.methods`` that register
nothing (shared bases such as ``base`` and ``affine_base``)."""

import ast
from pathlib import Path

import kvbench.methods

METHODS_DIR = Path(kvbench.methods.__file__).parent


def _tree(name: str) -> ast.Module:
    return ast.parse((METHODS_DIR / f"{name}.py").read_text(encoding="utf-8"))


def registers(tree: ast.Module) -> bool:
    """Whether the module calls ``register_method`` (as a decorator or a plain call)."""
    return any(
        isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "register_method"
        for node in ast.walk(tree)
    )


def imported_method_modules(tree: ast.Module) -> set[str]:
    """Names of ``kvbench.methods`` submodules a module imports, at any depth of its code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("kvbench.methods."):
                found.add(node.module.split(".")[2])
            elif node.module == "kvbench.methods":
                found.update(
                    alias.name for alias in node.names if (METHODS_DIR / f"{alias.name}.py").exists()
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvbench.methods."):
                    found.add(alias.name.split(".")[2])
    return found


def modules() -> dict[str, ast.Module]:
    return {p.stem: _tree(p.stem) for p in sorted(METHODS_DIR.glob("*.py")) if p.stem != "__init__"}


def test_no_method_imports_another_method():
    trees = modules()
    registering = {name for name, tree in trees.items() if registers(tree)}
    assert {"kivi", "ott", "specache", "semkv", "turboquant"} <= registering  # the walk sees them
    assert "base" not in registering and "affine_base" not in registering
    offences = {
        name: sorted(imported_method_modules(tree) & registering)
        for name, tree in trees.items()
        if name in registering and imported_method_modules(tree) & registering
    }
    assert offences == {}, f"method modules importing other method modules: {offences}"


def test_the_walk_catches_a_method_importing_a_method():
    tree = ast.parse("from kvbench.methods.kivi import KIVIConfig\n@register_method('x')\nclass X: pass\n")
    assert registers(tree) and imported_method_modules(tree) == {"kivi"}
    lazy = ast.parse("def f():\n    import kvbench.methods.ott\n")
    assert imported_method_modules(lazy) == {"ott"} and not registers(lazy)
