"""``POST /v1/embeddings`` through a real ``cachesvc serve --task embed`` and the official
``openai`` SDK: vectors equal to transformers' (final hidden state, last-token pooled, L2
normalised), every input form, float and base64, usage, and the 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import transformers as tf

from tests.service.conftest import API_KEY, MODEL, ServerProcess, running_server

EMBED = "demo-embed"
TEXTS = ["Hello world", "Caches keep compiled engines on disk, evicted least recently used first.", "x"]


@pytest.fixture(scope="module")
def embed_server(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                 log_dir: Path) -> Iterator[ServerProcess]:
    # A cache of its own: the shared one serves demo-tiny's generate bundle under that name.
    cache = tmp_path_factory.mktemp("embed-cache")
    with running_server(demo_dir, cache, log_dir, "--task", "embed", "--served-model-name", EMBED,
                        "--max-input-len", "64", "--max-kv-cache-capacity", "128", api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def reference(demo_dir: Path) -> tuple[tf.PreTrainedTokenizerBase, tf.PreTrainedModel]:
    tok = tf.AutoTokenizer.from_pretrained(demo_dir)
    model = tf.AutoModel.from_pretrained(demo_dir, dtype=torch.float32).eval()
    return tok, model


def _expected(reference: tuple[tf.PreTrainedTokenizerBase, tf.PreTrainedModel], ids: list[int]) -> np.ndarray:
    _, model = reference
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return np.asarray(hidden / np.linalg.norm(hidden))


def test_vectors_match_transformers_in_every_encoding(embed_server: ServerProcess, reference: tuple) -> None:
    client = embed_server.client()
    tok, _ = reference
    ids = [tok(text)["input_ids"] for text in TEXTS]
    want = np.stack([_expected(reference, i) for i in ids])
    resp = client.embeddings.create(model=EMBED, input=TEXTS)  # the SDK asks for base64
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert resp.model == EMBED
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in ids)
    assert (got * want).sum(axis=1).min() >= 0.9999
    as_float = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in as_float.data], got, rtol=0, atol=1e-6)
    # Token ids: one list is one input, a list of lists is several.
    one = client.embeddings.create(model=EMBED, input=ids[1])
    np.testing.assert_allclose(one.data[0].embedding, got[1], rtol=0, atol=1e-5)
    many = client.embeddings.create(model=EMBED, input=ids)
    np.testing.assert_allclose([d.embedding for d in many.data], got, rtol=0, atol=1e-5)
    single = client.embeddings.create(model=EMBED, input=TEXTS[0])
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(ids[0])


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "empty list"),
    ({"input": ["ok", ""]}, "input", "input[1] is empty"),
    ({"input": ["ok", [1, 2]]}, "input", "may not mix"),
    ({"input": "word " * 200}, "input", "embeds at most 64"),
    ({"input": [[10**7]]}, "input", "outside"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "not trained for truncated embeddings"),
    ({"input": "hi", "dimensions": 100000}, "dimensions", "exceeds"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "pooling": "mean"}, "pooling", ""),
])
def test_bad_requests_are_400s_naming_the_field(embed_server: ServerProcess, body: dict,
                                                 param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        embed_server.client().post("/embeddings", body={"model": EMBED, **body}, cast_to=object)
    error = err.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
    assert words in str(error.get("message")), error


def test_an_embedding_model_generates_nothing(embed_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        embed_server.client().chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "hi"}])


def test_a_text_model_has_no_embeddings(real_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="--task embed") as err:
        real_server.client().embeddings.create(model=MODEL, input="hello")
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "model"


def _raw_post(server: ServerProcess, path: str, body: bytes) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with server.http() as h:
        r = h.post(path, content=body, headers=headers)
    return r.status_code, r.json()


@pytest.mark.parametrize(("text", "param", "where"), [
    (rb'"\ud800"', "input", "input, character 0: \\ud800"),
    (rb'["ok", "ab\udc00"]', "input[1]", "input[1], character 2: \\udc00"),
    (rb'["ok", "x", "a\ud800b"]', "input[2]", "input[2], character 1: \\ud800"),
])
def test_an_unpaired_surrogate_is_a_400_naming_where(embed_server: ServerProcess, text: bytes,
                                                     param: str, where: str) -> None:
    # A lone surrogate escape is JSON that no UTF-8 text can hold (msgspec said "Input data was
    # truncated"): the answer says so, and where.
    status, body = _raw_post(embed_server, "/v1/embeddings", b'{"model": "' + EMBED.encode() + b'", "input": '
                             + text + b"}")
    error = body["error"]
    assert status == 400 and error["param"] == param, body
    assert "unpaired UTF-16 surrogate" in error["message"] and where in error["message"], body
    assert "truncated" not in error["message"], body


def test_bytes_that_are_not_utf8_are_a_400_naming_the_offset(embed_server: ServerProcess) -> None:
    raw = b'{"model": "' + EMBED.encode() + b'", "input": "caf\xe9"}'
    status, body = _raw_post(embed_server, "/v1/embeddings", raw)
    assert status == 400, body
    assert "not valid UTF-8" in body["error"]["message"], body
    offset = raw.index(b"\xe9")
    assert f"byte {offset}" in body["error"]["message"], body


def test_a_surrogate_pair_is_one_character(embed_server: ServerProcess) -> None:
    pair = b'{"model": "' + EMBED.encode() + rb'", "input": ["\ud83d\ude00 ok"]}'
    status, body = _raw_post(embed_server, "/v1/embeddings", pair)
    assert status == 200 and len(body["data"]) == 1, body
