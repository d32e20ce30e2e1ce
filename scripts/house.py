"""The house's numbers (issue 44): import layers and cycles, the largest modules and the longest functions.

Reads the source only (no imports run): ``python scripts/house.py [--top N]`` from the repository root.
A module's layer is 0 if it imports nothing of the package, else one more than the highest layer it imports
(importing ``a.b.c`` imports the packages ``a.b`` and ``a`` first, so their ``__init__`` counts as imported);
a cycle is reported instead of a layer.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jakiro_lib"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str], package_dir: Path = PACKAGE) -> set[str]:
    """The package modules ``path`` imports (a package's ``__init__`` counts when a name is not a module)."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first: each parent package is imported too
    found |= {".".join(m.split(".")[:i]) for m in set(found) for i in range(2, m.count(".") + 1)}
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def measure(package: Path = PACKAGE) -> dict:
    """Modules, lines, import layers and arrows, cycles, module sizes and function lengths of ``package``."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(f, package): f for f in files}
    graph = {m: imports(f, set(modules), package) for m, f in modules.items()}
    layer: dict[str, int] = {}
    cycles: set[str] = set()

    def visit(m: str, stack: tuple[str, ...]) -> int:
        if m in stack:
            cycles.add(" -> ".join((*stack[stack.index(m):], m)))
            return 0
        if m not in layer:
            layer[m] = 1 + max((visit(d, (*stack, m)) for d in graph[m]), default=-1)
        return layer[m]

    for m in modules:
        visit(m, ())
    sizes = sorted(((len(f.read_text().splitlines()), m) for m, f in modules.items()), reverse=True)
    funcs = sorted(((node.end_lineno - node.lineno + 1, f"{m}.{node.name}") for m, f in modules.items()
                    for node in ast.walk(ast.parse(f.read_text()))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), reverse=True)
    return {"modules": len(modules), "lines": sum(n for n, _ in sizes), "layers": max(layer.values()) + 1,
            "arrows": sum(len(v) for v in graph.values()), "cycles": sorted(cycles), "sizes": sizes,
            "functions": funcs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    h = measure()
    print(f"{h['modules']} modules, {h['lines']} lines, {h['layers']} import layers, {h['arrows']} import arrows, "
          f"{len(h['cycles'])} cycles")
    for c in h["cycles"]:
        print("  cycle:", c)
    print("largest modules:", ", ".join(f"{m} {n}" for n, m in h["sizes"][: args.top]))
    print("longest functions:", ", ".join(f"{m} {n}" for n, m in h["functions"][: args.top]))
    print(f"functions over 60 lines: {sum(1 for n, _ in h['functions'] if n > 60)}; "
          f"modules over 400 lines: {sum(1 for n, _ in h['sizes'] if n > 400)}")


if __name__ == "__main__":
    main()
