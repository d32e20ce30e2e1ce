"""The documentation holds together: design-doc citations, relative links, README size and headline
table, and the environment files agreeing with pyproject.toml. Text only: no model, no kernel."""
from __future__ import annotations

import csv
import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
README = ROOT / "README.md"
README_MAX_BYTES = 12 * 1024

# "DESIGN.md section 4", "docs/DESIGN.md sections 2-3", "DESIGN.md sections 3 and 5", "DESIGN.md 4",
# "DESIGN.md §4, §9": the section list that follows a mention of the design doc.
_NUMBERS = r"(\d+(?:\s*(?:-|–|,|and)\s*(?:§\s*)?\d+)*)"
CITATION = re.compile(r"(?:docs/)?DESIGN\.md\s*(?:(?:sections?|§)\s*)?" + _NUMBERS)
BARE_SECTION = re.compile(r"(?<!DESIGN\.md )§\s*" + _NUMBERS)  # "§4" on its own: the design doc too
HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)
# The subjects that sections 1-9 keep, because code cites them by number.
SUBJECTS = {1: "speculative decoding", 2: "draft", 3: "moe", 4: "training", 5: "inference",
            6: "verification", 7: "metrics", 8: "published", 9: "offline"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def cited_sections(text: str) -> list[int]:
    """Every design-doc section number that ``text`` cites, ranges expanded."""
    cited = list(CITATION.finditer(text))
    spans = [range(*m.span()) for m in cited]
    bare = [m for m in BARE_SECTION.finditer(text) if not any(m.start() in s for s in spans)]
    out: list[int] = []
    for match in cited + bare:
        for lo, hi in re.findall(r"(\d+)(?:\s*[-–]\s*§?\s*(\d+))?", match.group(1)):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def design_sections() -> dict[int, str]:
    text = DESIGN.read_text(encoding="utf-8")
    return {int(m.group(1)): text[m.start():text.index("\n", m.start())] for m in HEADING.finditer(text)}


def _notebook_text(path: Path) -> str:
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text(encoding="utf-8"))["cells"])


def citing_files() -> dict[Path, str]:
    """Code (recursively, so that packages such as ``jakiro_lib/study/`` count), notebooks, docs."""
    files = [*sorted((ROOT / "jakiro_lib").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
             README, ROOT / "reports" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {p: p.read_text(encoding="utf-8") for p in files if p.is_file() and p != Path(__file__).resolve()}
    texts.update({p: _notebook_text(p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))})
    return texts


def test_citation_parser_reads_every_form():
    assert cited_sections("(DESIGN.md section 4): x") == [4]
    assert cited_sections("docs/DESIGN.md sections 2-3, and DESIGN.md sections 3 and 5") == [2, 3, 3, 5]
    assert cited_sections("(DESIGN.md 9): small; DESIGN.md §4, §9 and DESIGN.md §7, Spec-Bench") == [9, 4, 9, 7]
    assert cited_sections("numbers of §8 (labelled); DESIGN.md section 4, EAGLE-3") == [4, 8]
    assert cited_sections("design notes in `DESIGN.md`, 2000 conversations") == []


def test_design_doc_keeps_the_cited_subjects():
    sections = design_sections()
    assert set(range(1, 12)) <= set(sections), sorted(sections)
    for number, subject in SUBJECTS.items():
        assert subject in sections[number].lower(), (number, sections[number])


def test_every_design_citation_points_to_an_existing_section():
    existing = set(design_sections())
    found, missing = 0, []
    for path, text in citing_files().items():
        for number in cited_sections(text):
            found += 1
            if number not in existing:
                missing.append(f"{path.relative_to(ROOT)}: section {number}")
    assert found >= 20, f"only {found} citations found: is the scanner reading the sources?"
    assert not missing, missing


def test_notebook_markdown_cites_the_file_in_the_repository():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                assert not re.search(r"(?<!docs/)DESIGN\.md", text), (path.name, text[:200])
                assert "§" not in text, (path.name, text[:200])


def _markdown_files() -> list[Path]:
    return [README, ROOT / "reports" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "reports" / "measured").glob("*/README.md"))]


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(path.read_text(encoding="utf-8"))
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_relative_links_resolve():
    broken, seen = [], 0
    for path in _markdown_files():
        for target in relative_links(path):
            seen += 1
            if not (path.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert seen >= 5 and not broken, (seen, broken)


def test_readme_is_short_and_points_to_the_docs():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= README_MAX_BYTES
    for needed in ("make reproduce", "make test", "make lab", "docs/DESIGN.md", "docs/results.md",
                   "reports/measured/h100-bf16-2026-11-22/"):
        assert needed in text, needed


# ---- the README's headline table is the committed CSV, number for number --------------------------

HEADLINE = re.compile(r"<!-- headline: (\S+) -->\n(.*?)<!-- /headline -->", re.DOTALL)
HEADLINE_COLUMNS = ("T", "method", "tree tokens", "tokens/s", "speedup", "95% interval", "tau",
                    "greedy = vanilla")


def _fmt(value: str, digits: int) -> str:
    return "" if value == "" else f"{float(value):.{digits}f}"


def headline_rows(csv_path: Path) -> list[str]:
    """Markdown rows of a committed ``summary.csv`` (the columns of :data:`HEADLINE_COLUMNS`)."""
    rows = []
    with csv_path.open(newline="") as f:
        for r in csv.DictReader(f):
            # a lookup chain without a draft tree (lookup_only) has no total_tokens: "0+10"
            tree = "" if r["kind"] != "spec" else f"{int(float(r['total_tokens'] or 0))}" + (
                f"+{int(float(r['lookup_tokens']))}" if float(r["lookup_tokens"] or 0) else "")
            ci = (f"{_fmt(r['speedup_ci_low'], 2)}-{_fmt(r['speedup_ci_high'], 2)}"
                  if r["speedup_ci_low"] and float(r["speedup_ci_low"]) != float(r["speedup_ci_high"]) else "")
            same = (f"{int(float(r['greedy_same']))}/{int(float(r['greedy_compared']))}"
                    if r["greedy_compared"] else "")
            cells = [f"{float(r['temperature']):g}", f"`{r['method']}`", tree, _fmt(r["tokens_per_s"], 1),
                     _fmt(r["speedup"], 2), ci, _fmt(r["tau"], 2), same]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_readme_headline_table_is_the_committed_csv():
    match = HEADLINE.search(README.read_text(encoding="utf-8"))
    assert match, "README.md needs a <!-- headline: reports/measured/<run>/summary.csv --> table"
    source = ROOT / match.group(1)
    assert source.is_file() and source.is_relative_to(ROOT / "reports" / "measured"), source
    lines = [ln for ln in match.group(2).strip().splitlines() if ln.startswith("|")]
    assert lines[0] == "| " + " | ".join(HEADLINE_COLUMNS) + " |"
    assert lines[2:] == headline_rows(source)


# ---- the environment the project names ---------------------------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_environment_yml_matches_pyproject():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    wanted = {d for d in project["dependencies"] if not d.startswith("torch")}
    wanted |= {d for name in ("lab", "hub", "test") for d in extras[name]}
    text = (ROOT / "environment.yml").read_text(encoding="utf-8")
    pip = set(re.findall(r'^\s+- "([^"]+)"$', text, re.MULTILINE)) - {"-e ."}
    assert pip == wanted, (sorted(pip - wanted), sorted(wanted - pip))
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert f"- py{torch}" in text  # conda's name for the same range


def test_make_installs_lab_and_datasets():
    extras = _pyproject()["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["lab"]}
    assert {"jupyterlab", "datasets"} <= names
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    install = re.search(r'pip install -q -e "\.\[([^\]]+)\]"', makefile)
    assert install and {"test", "lab"} <= set(install.group(1).split(","))
    assert makefile.index('"torch==') < install.start()  # the CPU wheel before anything that needs torch
    assert re.search(r"^lab: .*\n\t.*jupyter lab", makefile, re.MULTILINE)


def test_license_is_an_spdx_string():
    assert _pyproject()["project"]["license"] == "Apache-2.0"  # PEP 639; the {text = ...} table is deprecated
