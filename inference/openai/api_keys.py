"""API keys as requests present them, compared in constant time: one home for the OpenAI routes'
key check and the admin API's (``cachesvc.http.auth``)."""

from __future__ import annotations

import hmac


def presented_keys(authorization: str | None, x_api_key: str | None) -> list[str]:
    """Credentials a request carries: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    keys: list[str] = []
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
    if x_api_key and x_api_key.strip():
        keys.append(x_api_key.strip())
    return keys


def any_key_matches(candidates: list[str], expected: str) -> bool:
    """Constant-time check of every candidate (no early exit, so timing does not reveal which)."""
    want = expected.encode("utf-8")
    ok = False
    for cand in candidates:
        ok |= hmac.compare_digest(cand.encode("utf-8"), want)
    return ok
