"""The house's floor plan holds (issue 44): stage folders, no import cycle, fewer import layers than the flat
package had (15 by scripts/house.py at 85a950c and at 2877f29: 14 arrows deep, the issue's count)."""
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
