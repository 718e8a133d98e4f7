"""docs/configuration.md's table of settings is the declarations of cachesvc/settings/groups.py."""

from __future__ import annotations

import re
from pathlib import Path

from cachesvc.settings.config import settings_table
from cachesvc.settings.groups import DECLARED, ENVIRONMENT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_docs_table_is_the_declarations() -> None:
    text = DOCS.read_text()
    table = re.search(r"<!-- settings:start -->\n(.*)<!-- settings:end -->", text, re.S)
    assert table is not None, "docs/configuration.md lost its generated table markers"
    assert table.group(1) == settings_table(), (
        "regenerate the table: python -c 'from cachesvc.settings.config import settings_table; "
        "print(settings_table(), end=\"\")'"
    )


def test_the_table_names_every_flag_and_variable() -> None:
    table = settings_table()
    for item in DECLARED.values():
        assert f"`{item.flag}" in table or item.spec.section is None, item.name
    for var in ENVIRONMENT:
        assert f"`{var.name}`" in table, var.name
