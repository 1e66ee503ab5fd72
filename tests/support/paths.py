"""Where the tests find the repository's files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (tests/support/paths.py)
RESULTS = ROOT / "docs" / "results"  # the committed benchmark reports
