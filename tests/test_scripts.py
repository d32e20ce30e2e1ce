"""The scripts that more than one record uses (scripts/): each reproduces what its records committed."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engines_script_remakes_the_committed_engines_table(tmp_path):
    """scripts/engines.py from the default-drafts record's committed records and config gives its engines.csv
    byte for byte (the bootstrap intervals are seeded)."""
    record = ROOT / "reports" / "measured" / "2026-11-27-engines-default-cpu"
    _script("engines").main(str(record), str(tmp_path))
    assert (tmp_path / "engines.csv").read_text() == (record / "engines.csv").read_text()
