"""Every registered model family, built by ``cachesvc prepare`` and served by one ``cachesvc
serve`` process: the official ``openai`` client gets transformers' greedy answer from each
(issue 31). The demo checkpoint of each family (``inference.demo``, from the registry) carries
the family's distinctive features and a real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.families import family_names
from inference.tokenizer import load_tokenizer
from tests.service.conftest import ServerProcess, prepare_demo_checkpoints, running_server

FAMILIES = family_names()
PROMPT_IDS = [5, 17, 42, 7, 99, 3, 250, 11]
N_TOKENS = 8
PROFILE = ("--max-input-len", "64", "--max-kv-cache-capacity", "128")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("families")
    cache_dir = root / "cache"
    return cache_dir, prepare_demo_checkpoints(root, cache_dir, FAMILIES, *PROFILE)


def _expected(ckpt: Path) -> str:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS,
                             do_sample=False)
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in gen[0, len(PROMPT_IDS):] if int(t) not in eos_ids]
    return str(load_tokenizer(ckpt).decode(visible))


@pytest.fixture(scope="module")
def server(prepared: tuple[Path, dict[str, Path]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(None, prepared[0], tmp_path_factory.mktemp("log"), "--max-loaded-models", "2") as s:
        yield s


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_served_with_transformers_answer(
    server: ServerProcess, prepared: tuple[Path, dict[str, Path]], family: str
) -> None:
    ckpt = prepared[1][family]
    done = server.client().completions.create(model=str(ckpt), prompt=PROMPT_IDS, max_tokens=N_TOKENS,
                                              temperature=0)
    assert done.choices[0].text == _expected(ckpt)
