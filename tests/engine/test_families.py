"""The model family registry: one declaration per family, read by everything else."""

from __future__ import annotations

import re
from pathlib import Path

import transformers as tf

from inference import demo
from inference.families import FAMILIES, auto_parsers, family_names, family_of_gguf, support_table
from inference.openai.handle import AUTO_PARSERS
from tests.gguf.ggufs import GGUF_METADATA

DOCS = Path(__file__).resolve().parents[2] / "docs" / "model-families.md"


def test_the_docs_table_is_the_registry() -> None:
    text = DOCS.read_text()
    table = re.search(r"<!-- families:start -->\n(.*)<!-- families:end -->", text, re.S)
    assert table is not None, "docs/model-families.md lost its generated table markers"
    assert table.group(1) == support_table(), (
        "regenerate the table: python -c 'from inference.families import support_table; "
        "print(support_table())'")


def test_every_family_has_a_demo_checkpoint_a_gguf_case_and_a_transformers_class() -> None:
    assert family_names() == demo.ARCHS
    for family in FAMILIES:
        # A family llama.cpp cannot convert declares no GGUF architecture (and says why in its notes).
        assert family.name in GGUF_METADATA or not family.gguf_architectures, (
            f"{family.name} has no GGUF parity case (tests/gguf/ggufs.py)")
        assert hasattr(tf, family.config_class), family.config_class
        for arch in family.architectures:
            assert hasattr(tf, arch), arch


def test_the_parser_table_is_the_registrys() -> None:
    assert auto_parsers() == AUTO_PARSERS
    assert all(t in AUTO_PARSERS for f in FAMILIES for t in f.model_types)


def test_names_are_unique_across_families() -> None:
    for attr in ("architectures", "model_types"):
        seen = [x for f in FAMILIES for x in getattr(f, attr)]
        assert len(seen) == len(set(seen)), attr
    # A GGUF architecture has one default family; another that shares it (Mixtral is written as
    # "llama") tells its files apart by their metadata (gguf_match).
    defaults = [a for f in FAMILIES if f.gguf_match is None for a in f.gguf_architectures]
    assert len(defaults) == len(set(defaults))


def test_a_shared_gguf_architecture_goes_by_the_metadata() -> None:
    meta = {"expert_count": 8}
    assert family_of_gguf("llama", lambda key, default: meta.get(key, default)).name == "mixtral"
    assert family_of_gguf("llama", lambda key, default: default).name == "llama"
    assert family_of_gguf("llama").name == "llama"
