"""``/admin/models``: served-name aliases to a bundle, a checkpoint, or a checkpoint + profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.http.serving import AliasRequest
from cachesvc.manager import CacheManager
from cachesvc.profiles import PROFILE_FIELDS, ProfileRequest


def test_alias_to_a_checkpoint_with_a_profile_picks_that_bundle(
    client: TestClient[Litestar], manager: CacheManager, checkpoint: Path
) -> None:
    small = manager.prepare(str(checkpoint), ProfileRequest(max_input_len=64)).bundle_id
    default = manager.prepare(str(checkpoint)).bundle_id
    assert small != default
    r = client.put("/admin/models/chat-64", json={"model": str(checkpoint), "max_input_len": 64})
    assert r.status_code == 200, r.text
    assert r.json()["bundle_id"] == small and r.json()["model"] is None
    # Without profile fields the alias follows the checkpoint (its most recently used bundle).
    r = client.put("/admin/models/chat", json={"model": str(checkpoint)})
    assert r.status_code == 200 and r.json()["model"] == str(checkpoint)
    assert {a["name"]: a["bundle_id"] for a in client.get("/admin/models").json()} == {
        "chat": None,
        "chat-64": small,
    }


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "MODEL", "max_input_len": 32}, 404, "POST /admin/builds"),  # profile never built
        ({"model": "/nowhere/model", "max_input_len": 64}, 404, "not a checkpoint in the catalog"),
        ({"bundle_id": "BUNDLE", "max_input_len": 64}, 400, "go with model"),
        ({"model": "MODEL", "max_input_len": 0}, 400, "max_input_len"),
        ({"model": "MODEL", "precision": "fp8"}, 400, "precision"),
        ({"model": "MODEL", "max_input_len": 64, "oops": 1}, 400, "oops"),
    ],
)
def test_bad_profile_aliases_are_refused_and_change_nothing(
    client: TestClient[Litestar],
    manager: CacheManager,
    checkpoint: Path,
    body: dict[str, object],
    status: int,
    words: str,
) -> None:
    bundle = manager.prepare(str(checkpoint), ProfileRequest(max_input_len=64)).bundle_id
    checkpoints = manager.catalog.checkpoints.all()
    body = {k: (str(checkpoint) if v == "MODEL" else bundle if v == "BUNDLE" else v) for k, v in body.items()}
    r = client.put("/admin/models/chat", json=body)
    assert r.status_code == status, r.text
    assert words in r.text
    assert client.get("/admin/models").json() == []
    assert manager.catalog.checkpoints.all() == checkpoints  # nothing resolved, hashed or recorded


def test_an_alias_body_takes_every_build_profile_field() -> None:
    # An alias at a checkpoint with a profile names the bundle as POST /admin/builds would: a
    # profile field the body lacks (kernels, once) was a 500 on every aliased PUT.
    missing = set(PROFILE_FIELDS) - set(AliasRequest.__struct_fields__)
    assert not missing, f"PUT /admin/models/{{name}} lacks {sorted(missing)}"
