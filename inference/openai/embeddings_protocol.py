"""``POST /v1/embeddings`` wire types and the two pure steps around the engine.

:class:`EmbeddingRequest` is OpenAI's request (``input`` a string, a list of strings, a list of
token ids or a list of lists of token ids; ``encoding_format`` float or base64, which the
official SDK sends by default; ``dimensions``; ``user``). :func:`request_inputs` checks it into
a list of texts and token lists, naming the field of every error; :func:`embedding_response`
turns the engine's unit vectors into OpenAI's response (base64: little-endian float32, as the
SDK decodes it).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np

from inference.openai.errors import InvalidRequestError

#: OpenAI's limits per request: inputs in one list, and tokens over all of them.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/embeddings``."""

    model: str
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def request_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, in order: texts (to tokenize) and token-id lists (as given)."""
    raw = req.input
    if isinstance(raw, str):
        inputs: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        inputs = [[int(x) for x in raw]]  # type: ignore[arg-type]
    elif raw and (all(isinstance(x, str) for x in raw) or all(isinstance(x, list) for x in raw)):
        inputs = list(raw)  # type: ignore[arg-type]
    elif not raw:
        raise InvalidRequestError("input is an empty list: give at least one string or token list",
                                  param="input")
    else:
        raise InvalidRequestError(
            "input must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids; a list may not mix these", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"input lists {len(inputs)} inputs; at most {MAX_INPUTS} are allowed "
                                  "per request", param="input")
    for i, item in enumerate(inputs):
        where = f"input[{i}]" if len(inputs) > 1 else "input"
        if len(item) == 0:
            raise InvalidRequestError(f"{where} is empty: embeddings need at least one token",
                                      param="input")
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequestError(f"dimensions must be a positive integer, got {req.dimensions}",
                                  param="dimensions")
    return inputs


def check_dimensions(requested: int | None, full: int, truncations: list[int] | None) -> int:
    """The vector size to return: ``full`` unless ``requested`` names a size the model allows
    (``truncations`` None: none below full; []: any; else those listed)."""
    if requested is None or requested == full:
        return full
    if requested > full:
        raise InvalidRequestError(f"dimensions {requested} exceeds this model's embedding size {full}",
                                  param="dimensions")
    if truncations is None:
        raise InvalidRequestError(
            f"this model was not trained for truncated embeddings (no Matryoshka dimensions in its "
            f"config); omit dimensions or set it to {full}", param="dimensions")
    if truncations and requested not in truncations:
        allowed = ", ".join(str(d) for d in [*truncations, full] if d <= full)
        raise InvalidRequestError(f"dimensions {requested} is not one this model supports ({allowed})",
                                  param="dimensions")
    return requested


def embedding_response(vectors: np.ndarray, *, model: str, encoding_format: str,
                       prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response for ``vectors`` ``[n, dim]`` float32."""
    data = []
    for index, row in enumerate(np.asarray(vectors, dtype="<f4")):
        embedding: Any = (base64.b64encode(row.tobytes()).decode("ascii") if encoding_format == "base64"
                          else row.tolist())
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
