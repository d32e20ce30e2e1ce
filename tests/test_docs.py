"""The documentation holds together: design-doc citations, relative links, README size and headline
table, the numbers of README prose that cites a record, and the environment files agreeing with
pyproject.toml. Text only: no model, no kernel."""
from __future__ import annotations

import csv
import functools
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


# ---- a number in the README's prose that cites a record is in that record's tables ---------------
#
# A sentence of README prose that links a record (reports/measured/<run>/...) speaks for that record:
# every number in it must be one of the values of the record's committed tables (its *.csv and *.json,
# subfolders included; raw records.jsonl and prose READMEs are not tables), to within the rounding it
# is written with. The rule reads clauses: a sentence is cut at "; ", and a clause without a link
# speaks for the nearest linked clause of its sentence (the one before it, else the one after).
# Names are not numbers (top-1, EAGLE-2, 2-core, 384-token, fp32, q1-10, T=0), nor are dates, clock
# times, link texts and `code`. A unit scales the table's value: 2.4k, 5.51M, 21%, 34.1 min (of
# seconds or minutes); 1.10x is a ratio as its table holds it.

MEASURED = "reports/measured/"
_N = r"\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?"
PROSE_NUMBER = re.compile(rf"(?<![\w.\-/=])({_N})(?:(?:-|–| to )({_N}))?([kMx%]|\s+min(?:utes)?\b)?(?![\w\-])")
UNIT_SCALES = {"": (1.0,), "k": (1e-3,), "M": (1e-6,), "x": (1.0,), "%": (100.0, 1.0), "min": (1.0, 1 / 60)}


def _prose_paragraphs(text: str) -> list[str]:
    """The README without code blocks, the headline table, tables and headings; list items apart."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = HEADLINE.sub("", text)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("|", "#"))]
    paragraphs = re.split(r"\n\s*\n|\n(?=\s*[-*] )", "\n".join(lines))
    return [" ".join(p.split()) for p in paragraphs if p.strip()]


def _linked_records(text: str) -> list[str]:
    return sorted({target.split(MEASURED, 1)[1].split("/", 1)[0] for target in LINK.findall(text)
                   if MEASURED in target} - {""})


def record_claims(text: str) -> list[tuple[str, list[str]]]:
    """(clause, the records it speaks for) for every clause of prose that a linked record covers."""
    claims = []
    for paragraph in _prose_paragraphs(text):
        for sentence in re.split(r"(?<=\.)\s+(?=[A-Z(\[`])", paragraph):
            clauses = re.split(r";\s+", sentence)
            linked = [_linked_records(c) for c in clauses]
            for i, clause in enumerate(clauses):
                order = [i, *range(i - 1, -1, -1), *range(i + 1, len(clauses))]
                nearest = [linked[j] for j in order if linked[j]]
                if nearest:
                    claims.append((clause, nearest[0]))
    return claims


def prose_numbers(clause: str) -> list[tuple[str, str]]:
    """(number as written, unit) for each number of ``clause``; a range gives both ends the unit."""
    text = re.sub(r"`[^`]*`", " ", LINK.sub(" ", clause))
    text = re.sub(r"\d{4}-\d\d-\d\d|\d\d?:\d\d", " ", text)
    return [(n, (m.group(3) or "").strip()[:3]) for m in PROSE_NUMBER.finditer(text) for n in m.group(1, 2) if n]


@functools.cache
def record_values(record: str) -> tuple[float, ...]:
    """Every number of the record's committed tables (csv cells, json leaves)."""
    values: list[float] = []

    def leaves(node):
        if isinstance(node, dict):
            for v in node.values():
                leaves(v)
        elif isinstance(node, list):
            for v in node:
                leaves(v)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.append(float(node))

    for path in sorted((ROOT / MEASURED / record).rglob("*")):
        if path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                for row in csv.reader(f):
                    for cell in row:
                        try:
                            values.append(float(cell))
                        except ValueError:
                            pass
        elif path.suffix == ".json":
            leaves(json.loads(path.read_text(encoding="utf-8")))
    return tuple(values)


def shown_by(written: str, unit: str, values: tuple[float, ...]) -> bool:
    """Whether ``written`` (in ``unit``) is one of ``values`` rounded to the digits it is written with."""
    number = float(written.replace(",", ""))
    half = 0.5 * 10.0 ** -(len(written.split(".")[1]) if "." in written else 0)
    return any(abs(v * scale - number) <= half * (1 + 1e-9) for v in values for scale in UNIT_SCALES[unit])


def unsupported_numbers(text: str) -> tuple[list[str], int]:
    """The numbers of record-citing prose that the cited records' tables do not hold, and how many were read."""
    missing, read = [], 0
    for clause, records in record_claims(text):
        values = tuple(v for r in records for v in record_values(r))
        for written, unit in prose_numbers(clause):
            read += 1
            if not shown_by(written, unit, values):
                missing.append(f"{written}{unit} not in {', '.join(records)}: {clause[:120]}")
    return missing, read


# The sentence that issue 43 found: two records' numbers behind a link to the one that holds neither.
_MIXED = ("On a 2-core AVX2 EPYC (no bf16 units, 2026-11-23), caching ran at 307-416 tokens/s and dense "
          "training at 2.4-2.6k ([table](reports/measured/2026-11-23-amd-epyc-2core/README.md)).")


def test_prose_number_check_reads_every_form():
    assert prose_numbers("top-1 0.566, EAGLE-2's 1.12x, 2-core, q1-10, T=0, x86-64, fp32, 20/20") == [
        ("0.566", ""), ("1.12", "x"), ("20", "")]
    assert prose_numbers("307-416 tokens/s, 2.4-2.6k, 3,740 to 15,072, 21%, 34.1 min, at `c3f9a69`, "
                         "2026-11-23 12:30 UTC, [2](x)") == [
        ("307", ""), ("416", ""), ("2.4", "k"), ("2.6", "k"), ("3,740", ""), ("15,072", ""), ("21", "%"),
        ("34.1", "min")]
    assert shown_by("1,943", "", (1943.3763882542348,)) and shown_by("2.6", "k", (2601.69,))
    assert shown_by("0.58", "", (0.5849,)) and shown_by("34.1", "min", (2046.0,))
    assert shown_by("21", "%", (0.214,)) and shown_by("5.51", "M", (5509982,))
    assert not shown_by("2.4", "k", (2560.6,)) and not shown_by("0.58", "", (0.5851,))
    claims = record_claims("Held-out 0.5 ([a](reports/measured/a/README.md)); then 0.6; "
                           "and 0.7 ([b](reports/measured/b/README.md)). Unlinked 0.8.")
    assert [(c.split()[0], r) for c, r in claims] == [("Held-out", ["a"]), ("then", ["a"]), ("and", ["b"])]


def test_prose_number_check_fails_on_a_number_from_another_record():
    missing, read = unsupported_numbers(_MIXED)
    assert read == 4
    assert [m.split(" ", 1)[0] for m in missing] == ["416", "2.4k", "2.6k"], missing
    fixed = _MIXED.replace("307-416", "307-323").replace("2.4-2.6k", "1,943-1,974")
    assert unsupported_numbers(fixed) == ([], 4)


def test_readme_prose_numbers_are_in_the_cited_records():
    missing, read = unsupported_numbers(README.read_text(encoding="utf-8"))
    assert read >= 25, f"only {read} numbers read next to record links: is the scanner reading the README?"
    assert not missing, missing


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
