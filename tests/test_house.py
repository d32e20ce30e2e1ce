"""The house's floor plan holds (scripts/house.py): stage folders, no import cycle between modules or packages, no
import from a higher floor, no history in the code, and at most 14 import layers."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _house():
    spec = importlib.util.spec_from_file_location("house", ROOT / "scripts" / "house.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("house", module)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_and_fewer_layers():
    h = _house().measure()
    assert h["cycles"] == [] and h["layers"] <= 14, (h["cycles"], h["layers"])
    assert h["package_cycles"] == [] and h["upward"] == [], (h["package_cycles"], h["upward"])
    assert h["history"] == [], h["history"]
    stages = {"data", "models", "training", "decoding", "measure", "report", "study"}
    assert stages <= {p.name for p in (ROOT / "jakiro_lib").iterdir() if (p / "__init__.py").is_file()}


def test_house_counts_a_cycle_and_a_layer(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "a.py").write_text("from .sub.b import f\n\n\ndef g():\n    return f()\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")
    house = _house()
    h = house.measure(pkg)
    assert (h["layers"], h["cycles"], h["functions"][0][0]) == (2, [], 2)
    (pkg / "sub" / "b.py").write_text("from ..a import g\n\n\ndef f():\n    return 1\n")
    assert house.measure(pkg)["cycles"] == ["pkg.a -> pkg.sub.b -> pkg.a"]
    # importing pkg.sub.b runs pkg/sub/__init__.py first: a package that imports back is a cycle too
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (pkg / "sub" / "__init__.py").write_text("from ..a import g\n")
    assert house.measure(pkg)["cycles"] == ["pkg.a -> pkg.sub -> pkg.a"]


def test_house_finds_an_upward_import_a_package_cycle_and_history(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text('"""Says what it does."""\n')
    (pkg / "high" / "b.py").write_text("from ..low.a import f\n")
    house = _house()
    floors = (("low", ("low",)), ("high", ("high",)))
    h = house.measure(pkg, floors)
    assert (h["upward"], h["package_cycles"], h["history"]) == ([], [], [])
    (pkg / "low" / "c.py").write_text("from ..high.b import f  # measured 2026-01-02 on a lent GPU\n")
    h = house.measure(pkg, floors)
    assert h["upward"] == ["pkg.low.c -> pkg.high", "pkg.low.c -> pkg.high.b"] and h["cycles"] == []
    assert h["package_cycles"] == ["high -> low -> high"] and len(h["history"]) == 1
    (pkg / "low" / "c.py").write_text("# the released head, silently\n")
    assert house.measure(pkg, floors)["history"] == []
