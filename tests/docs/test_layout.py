"""tests/ follows tests/README.md: every test file has one tier in ``TIERS`` and sits in a listed area."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import TIER_MARKERS, TIERS

TESTS = Path(__file__).resolve().parents[1]


def _test_files() -> set[str]:
    return {p.relative_to(TESTS).as_posix() for p in TESTS.glob("*/**/test_*.py")}


def test_every_test_file_has_a_tier_and_every_entry_a_file() -> None:
    files = _test_files()
    assert not sorted(files - TIERS.keys()), "add these files to TIERS in tests/conftest.py"
    assert not sorted(TIERS.keys() - files), "TIERS names files that do not exist"


def test_each_file_has_exactly_one_tier_plus_optional_slow() -> None:
    for name, markers in TIERS.items():
        tiers = [m for m in markers if m in TIER_MARKERS]
        assert len(tiers) == 1, f"{name}: one of {TIER_MARKERS}, got {markers}"
        assert set(markers) <= {*TIER_MARKERS, "slow"}, f"{name}: unknown marker in {markers}"


def test_every_area_folder_is_in_the_readme_table() -> None:
    table = (TESTS / "README.md").read_text()
    listed = set(re.findall(r"\| `tests/([a-z_]+)/` \|", table))
    folders = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.glob("*/**/test_*.py")}
    assert folders <= listed, f"folders missing from tests/README.md: {sorted(folders - listed)}"
    assert listed <= {p.name for p in TESTS.iterdir() if p.is_dir()}, "tests/README.md lists a missing folder"


def test_the_markers_are_registered(pytestconfig: pytest.Config) -> None:
    registered = "\n".join(pytestconfig.getini("markers"))
    for marker in (*TIER_MARKERS, "slow", "gpu"):
        assert re.search(rf"^{marker}:", registered, re.M), f"marker {marker} is not in pyproject.toml"
