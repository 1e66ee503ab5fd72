"""Section references into the design document resolve (docs/architecture.md).

Code and docs cite the design as ``docs/architecture.md §N`` (e.g. "(docs/architecture.md §4)"). Every
such N must be a ``## N. …`` heading of docs/architecture.md, and nothing may cite the old design file
outside the repository (its upper-case name ``ARCHITECTURE`` followed by ``§N``). Scans vtoken/, tests/, docs/,
dashboards/, k8s/
(*.py, *.md), README.md and serve_app.py. Pure file reading, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.paths import ROOT

DOC = ROOT / "docs" / "architecture.md"
SCAN_DIRS = ("vtoken", "tests", "docs", "dashboards", "k8s")
SCAN_FILES = ("README.md", "serve_app.py")
SUFFIXES = (".py", ".md")

REFERENCE = re.compile(r"architecture\.md\s*§\s*(\d+)")  # the form the code uses
HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)  # "## 4. Invariants"
EXTERNAL = re.compile(r"\bARCHITECTURE(?:\.md)?\s*§")  # the old, out-of-repository design file


def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every file whose references are checked, sorted (build outputs and virtualenvs skipped)."""
    files = [root / name for name in SCAN_FILES if (root / name).is_file()]
    for d in SCAN_DIRS:
        for path in (root / d).rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                files.append(path)
    return sorted(files)


def section_numbers(doc_text: str) -> set[int]:
    """The N of every ``## N. Title`` heading."""
    return {int(n) for n in HEADING.findall(doc_text)}


def problems(text: str, sections: set[int], where: str = "<text>") -> list[str]:
    """One message per reference to a missing section and per reference to the external file (pure)."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in REFERENCE.finditer(line):
            if int(m.group(1)) not in sections:
                out.append(
                    f"{where}:{lineno}: '{m.group(0)}' but docs/architecture.md has no '## {m.group(1)}.' heading"
                )
        if EXTERNAL.search(line):
            out.append(f"{where}:{lineno}: cites the external design file: {line.strip()[:100]}")
    return out


def test_architecture_doc_numbers_its_sections_from_1():
    numbers = sorted(section_numbers(DOC.read_text(encoding="utf-8")))
    assert numbers[:7] == list(range(1, 8)), numbers
    assert numbers == list(range(1, len(numbers) + 1)), f"section numbers not consecutive: {numbers}"


def test_every_reference_names_an_existing_section_and_none_cites_the_external_file():
    sections = section_numbers(DOC.read_text(encoding="utf-8"))
    found = []
    for path in scanned_files():
        found += problems(path.read_text(encoding="utf-8"), sections, str(path.relative_to(ROOT)))
    assert not found, f"{len(found)} bad design references:\n" + "\n".join(found)


# ----------------------------------------------------------------- the checker itself (strings only)
# Built by concatenation so this file does not contain the patterns it looks for.
NEW = "docs/architecture" + ".md §"
OLD = "ARCHITECTURE" + " §"
SECTIONS = section_numbers("# t\n\n## 1. Problem\n## 2. Layers\n## 4. Invariants\n### 5. not a section\n")


def test_heading_parser_takes_only_numbered_level_two_headings():
    assert {1, 2, 4} == SECTIONS


@pytest.mark.parametrize(
    "text",
    [
        f'"""Every invariant of {NEW}4 that holds without an engine."""',
        f"# vLLM keeps one null block out of the pool ({NEW}4, invariant 2).",
        f"see {NEW}1 and {NEW}2",
        "no reference at all; § alone and architecture.md without a section are fine",
    ],
)
def test_fixed_references_pass(text):
    assert problems(text, SECTIONS) == []


@pytest.mark.parametrize(
    "text,needle",
    [
        (f"({NEW}3)", "no '## 3.' heading"),
        (f"({NEW}99)", "no '## 99.' heading"),
        (f"Invariant 5 of {OLD}4 says", "external design file"),
        (f"({OLD}6 keeps vLLM's names unchanged)", "external design file"),
        ("ARCHITECTURE.md" + " §2", "external design file"),
    ],
)
def test_broken_or_external_references_fail(text, needle):
    found = problems(text, SECTIONS, "x.py")
    assert len(found) == 1 and needle in found[0] and found[0].startswith("x.py:1:"), found


# ------------------------------------------------------------------ the support matrix (docs/support.md)
SUPPORT = ROOT / "docs" / "support.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
COLUMNS = ("feature", "supported", "refused", "untested")


def support_rows(text: str) -> list[dict[str, str]]:
    """The matrix rows (header and separator skipped) as dicts of the four columns (pure)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().split("|")[1:-1]] if line.startswith("|") else []
        if len(cells) == len(COLUMNS) and cells[0] not in ("feature", "---"):
            rows.append(dict(zip(COLUMNS, cells)))
    return rows


def test_support_matrix_names_existing_tests_and_one_column_per_row():
    """Every feature sits in exactly one column, every "supported" cell names its proving test, and every
    test the matrix names exists (file and function)."""
    text = SUPPORT.read_text()
    rows = support_rows(text)
    assert len(rows) >= 30
    for r in rows:
        marked = [c for c in ("supported", "refused", "untested") if "✓" in r[c]]
        assert len(marked) == 1, r["feature"]
        if marked == ["supported"]:
            assert TEST_REF.search(r["supported"]), f"{r['feature']}: a supported feature names its test"
    for path, name in TEST_REF.findall(text):
        assert (ROOT / path).is_file(), path
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), f"{path}::{name}"
    for doc in ("README.md", "docs/architecture.md"):
        assert "docs/support.md" in (ROOT / doc).read_text() or "(support.md)" in (ROOT / doc).read_text(), doc


def test_support_matrix_lists_every_feature_of_issue_11():
    features = " ".join(r["feature"].lower() for r in support_rows(SUPPORT.read_text()))
    for f in (
        "gqa",
        "mqa",
        "head dim",
        "bfloat16",
        "fp8",
        "sliding-window",
        "alibi",
        "soft-capping",
        "sinks",
        "mla",
        "pooling",
        "lora",
        "structured output",
        "prompt logprobs",
        "n > 1",
        "beam search",
        "speculative decoding",
        "prefix caching",
        "chunked prefill",
        "preemption",
        "tensor parallelism",
        "pipeline parallelism",
        "async scheduling",
        "cuda graphs",
    ):
        assert f in features, f


def test_support_matrix_refuses_micro_batching_and_mm_prefix_models_by_option():
    """Issue 41: dual-batch overlap (``enable_dbo``), micro-batching (``ubatch_size``) and mm-prefix LMs
    (``is_mm_prefix_lm``) sit in the refused column, each naming the test that builds those configs."""
    rows = support_rows(SUPPORT.read_text())
    for option in ("enable_dbo", "ubatch_size", "is_mm_prefix_lm"):
        named = [r for r in rows if option in r["feature"]]
        assert named, f"no support-matrix row names {option}"
        for r in named:
            assert "✓" in r["refused"] and TEST_REF.search(r["refused"]), r["feature"]


HEAVY = (
    "start_engine",
    "LLM(",
    "AsyncLLM",
    "run_cases",
    "LocalCluster",
    "ray.init",
    "PrometheusServer",
    "Popen",
    "subprocess.run",
    "serve.run",
    "default_model",
    "vllm.entrypoints",
    "small_pool_engine",
)


def test_unit_modules_start_no_engine_server_or_cluster_and_no_test_module_imports_another():
    """`make test-fast` runs tests/unit: a module there that builds an engine, a server or a cluster, or carries
    a ``slow`` test, belongs in tests/integration or tests/e2e (it would make the inner loop slow), and the fast
    set must not be empty. Shared helpers live in tests/support: no test module imports another."""
    unit = sorted((ROOT / "tests" / "unit").rglob("test_*.py"))
    assert len(unit) >= 20
    for path in unit:
        found = [h for h in (*HEAVY, "mark.slow") if h in path.read_text()]
        assert not found, (path.relative_to(ROOT), found)
    importing = re.compile(r"^\s*(?:from|import) (test_\w+)", re.MULTILINE)
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert not importing.findall(path.read_text()), (path.relative_to(ROOT), importing.findall(path.read_text()))
