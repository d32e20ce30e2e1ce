"""The scripts committed beside measured records (reports/measured/*/*.py remake their tables from the
records) still find what they import from the package: a rename inside jakiro_lib must not leave a record
whose one-line command fails (2026-11-27: two records imported names moved out of measure.bench)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_imports(source: str) -> list[tuple[str, str | None]]:
    """(module, name) for every ``from jakiro_lib... import name`` and (module, None) for ``import jakiro_lib...``."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jakiro_lib":
            out.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            out.extend((alias.name, None) for alias in node.names if alias.name.split(".")[0] == "jakiro_lib")
    return out


def missing(module: str, name: str | None) -> bool:
    """Whether ``from module import name`` (or ``import module``) would fail."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return True
    if name is None or hasattr(found, name):
        return False
    try:  # a submodule: `from jakiro_lib.models import loss`
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return True
    return False


def test_import_reader_sees_both_forms():
    src = "from jakiro_lib.measure.summary import versus, load_records\nimport jakiro_lib.models.draft as D\nimport os\n"
    assert package_imports(src) == [("jakiro_lib.measure.summary", "versus"),
                                    ("jakiro_lib.measure.summary", "load_records"), ("jakiro_lib.models.draft", None)]
    assert missing("jakiro_lib.measure.bench", "greedy_agreement")  # moved to measure.summary: caught
    assert missing("jakiro_lib.no_such_module", None)
    assert not missing("jakiro_lib.models", "loss") and not missing("jakiro_lib.measure.summary", "versus")


def test_every_record_script_imports_what_exists():
    scripts = sorted((ROOT / "reports" / "measured").rglob("*.py"))
    assert scripts, "no record scripts found"
    broken = [f"{path.relative_to(ROOT)}: {module} {name or ''}".strip()
              for path in scripts for module, name in package_imports(path.read_text(encoding="utf-8"))
              if missing(module, name)]
    assert not broken, "record scripts import names the package no longer has:\n" + "\n".join(broken)
