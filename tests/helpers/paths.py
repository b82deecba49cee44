"""Where the tests find the repository's files: ``FIXTURES`` (tests/fixtures), ``ROOT`` (the
repository: docs/, scripts/), ``BENCHMARKS`` (benchmarks/: the measurement tools)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
BENCHMARKS = ROOT / "benchmarks"
