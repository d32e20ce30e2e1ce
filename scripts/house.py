"""The house's numbers: floors and upward imports, import layers and cycles, module and function sizes, history.

Reads the source only (no imports run): ``python scripts/house.py [--top N]`` from the repository root; exits 1 when a
module imports from a higher floor, two packages import each other, or the code carries history (dates, issue
numbers, lent GPUs). A module's layer is 0 if it imports nothing of the package, else one more than the highest
layer it imports (importing ``a.b.c`` imports the packages ``a.b`` and ``a`` first, so their ``__init__`` counts).
"""
from __future__ import annotations

import argparse
import ast
import re
import statistics
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jakiro_lib"

# The floors, lowest first (docs/DESIGN.md section 10): a module may import its own floor and the floors below.
# A name is a subpackage or a top-level module of the package; the package's own __init__ is on the ground floor.
FLOORS = (
    ("base", ("errors", "files", "validation", "config", "layout", "machine", "precision", "distributed", "runlock",
              "busy", "profiles")),
    ("data", ("data",)),
    ("models", ("models",)),
    ("decoding", ("decoding",)),
    ("measure", ("measure",)),
    ("training", ("training",)),
    ("study", ("study",)),
    ("report", ("report",)),
    ("entry", ("api", "commands", "cli", "__main__")),
)
# History in the code: a date, an issue number, a lent GPU or its lease (whole words: "released" is not a lease)
HISTORY = re.compile(r"\b(20\d\d-\d\d-\d\d|[Ii]ssue \d+|lent|lease)\b")


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


def room(module: str) -> str:
    """The subpackage or top-level module ``module`` lives in ("" for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor(module: str, floors: tuple = FLOORS) -> int:
    """The floor index of ``module`` (0 for a room no floor names: the ground floor)."""
    return next((i for i, (_, rooms) in enumerate(floors) if room(module) in rooms), 0)


def _cycles(graph: dict[str, set[str]]) -> tuple[dict[str, int], set[str]]:
    layer: dict[str, int] = {}
    cycles: set[str] = set()

    def visit(m: str, stack: tuple[str, ...]) -> int:
        if m in stack:
            cycles.add(" -> ".join((*stack[stack.index(m):], m)))
            return 0
        if m not in layer:
            layer[m] = 1 + max((visit(d, (*stack, m)) for d in graph[m]), default=-1)
        return layer[m]

    for m in graph:
        visit(m, ())
    return layer, cycles


def measure(package: Path = PACKAGE, floors: tuple = FLOORS) -> dict:
    """Modules, lines, import layers and arrows, cycles (module and package), upward imports, sizes, history."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(f, package): f for f in files}
    graph = {m: imports(f, set(modules), package) for m, f in modules.items()}
    layer, cycles = _cycles(graph)
    rooms: dict[str, set[str]] = {}
    for m, deps in graph.items():
        rooms.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m) and room(m))
    _, room_cycles = _cycles({r: {d for d in ds if d} for r, ds in rooms.items() if r})
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if floor(d, floors) > floor(m, floors))
    texts = {m: f.read_text() for m, f in modules.items()}
    sizes = sorted(((len(t.splitlines()), m) for m, t in texts.items()), reverse=True)
    funcs = sorted(((node.end_lineno - node.lineno + 1, f"{m}.{node.name}") for m, t in texts.items()
                    for node in ast.walk(ast.parse(t))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), reverse=True)
    history = [f"{m}:{i}: {line.strip()}" for m, t in texts.items() for i, line in enumerate(t.splitlines(), 1)
               if HISTORY.search(line)]
    return {"modules": len(modules), "lines": sum(n for n, _ in sizes), "layers": max(layer.values()) + 1,
            "arrows": sum(len(v) for v in graph.values()), "cycles": sorted(cycles),
            "package_cycles": sorted(room_cycles), "upward": upward, "sizes": sizes, "functions": funcs,
            "history": history}


def distribution(values: list[int], marks: tuple[int, ...]) -> str:
    """Quartiles and the count over each mark, e.g. ``median 180, p90 330, max 399; >300: 9, >380: 2``."""
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    over = ", ".join(f">{m}: {sum(v > m for v in values)}" for m in marks)
    return f"median {statistics.median(values):.0f}, p90 {q[8]:.0f}, max {max(values)}; {over}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    h = measure()
    print(f"{h['modules']} modules, {h['lines']} lines, {h['layers']} import layers, {h['arrows']} import arrows, "
          f"{len(h['cycles'])} cycles, {len(h['package_cycles'])} package-level cycles, {len(h['upward'])} upward "
          f"imports, {len(h['history'])} history lines")
    for c in h["cycles"] + h["package_cycles"]:
        print("  cycle:", c)
    for u in h["upward"]:
        print("  upward:", u)
    for line in h["history"]:
        print("  history:", line)
    print("floors:", " < ".join(name for name, _ in FLOORS))
    print("largest modules:", ", ".join(f"{m} {n}" for n, m in h["sizes"][: args.top]))
    print("longest functions:", ", ".join(f"{m} {n}" for n, m in h["functions"][: args.top]))
    print("module lines:", distribution([n for n, _ in h["sizes"]], (300, 380, 400)))
    print("function lines:", distribution([n for n, _ in h["functions"]], (40, 55, 60)))
    return 1 if h["cycles"] or h["package_cycles"] or h["upward"] or h["history"] else 0


if __name__ == "__main__":
    sys.exit(main())
