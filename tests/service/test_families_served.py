"""Every registered model family, built by ``cachesvc prepare`` and served by one ``cachesvc
serve`` process: the official ``openai`` client gets transformers' greedy answer from each
(issue 31). The demo checkpoint of each family (``inference.demo``, from the registry) carries
the family's distinctive features and a real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.families import family_names
from inference.serving.tokenizer import load_tokenizer
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


def _expected(ckpt: Path, prompt: list[int] = PROMPT_IDS) -> str:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS,
                             do_sample=False)
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in gen[0, len(prompt):] if int(t) not in eos_ids]
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


#: A schema a random model completes in a few tokens (compact JSON: no free whitespace).
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_answers_structured_output_and_a_seen_prefix(
    server: ServerProcess, prepared: tuple[Path, dict[str, Path]], family: str
) -> None:
    """Structured output (a JSON schema over the family's own tokenizer) gives JSON that
    validates; a prompt extending one already answered is answered from its kept prefix with
    transformers' tokens for the longer prompt (issue 31, item 4)."""
    import json

    import jsonschema

    ckpt = prepared[1][family]
    client = server.client()
    done = client.chat.completions.create(
        model=str(ckpt), messages=[{"role": "user", "content": "Is it ok? Pick n."}], max_tokens=24,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    content = done.choices[0].message.content
    assert content is not None and done.choices[0].finish_reason == "stop", done
    jsonschema.validate(json.loads(content), ANSWER)
    first = client.completions.create(model=str(ckpt), prompt=PROMPT_IDS * 7, max_tokens=2, temperature=0)
    longer = [*PROMPT_IDS * 7, 33, 44]  # within the profile's 64 input tokens
    before = _tokens_reused(server)
    again = client.completions.create(model=str(ckpt), prompt=longer, max_tokens=N_TOKENS, temperature=0)
    assert first.choices[0].text is not None
    assert again.choices[0].text == _expected(ckpt, longer)
    assert _tokens_reused(server) - before >= 55  # the 56-token prefix, from the slot that kept it
    details = again.usage.prompt_tokens_details if again.usage is not None else None
    assert details is not None and (details.cached_tokens or 0) >= 55, again.usage  # as OpenAI reports it


def _tokens_reused(server: ServerProcess) -> float:
    """``cachesvc_context_cache_tokens_reused_total`` over every model, from ``/metrics``."""
    import httpx

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cachesvc_context_cache_tokens_reused_total"))
