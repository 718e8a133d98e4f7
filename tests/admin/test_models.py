"""``/admin/models``: served-name aliases to a bundle, a checkpoint, or a checkpoint + profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import PROFILE_FIELDS, ProfileRequest
from cachesvc.http.admin.models import AliasRequest


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


def test_bundles_and_stats_name_models_by_served_name(
    client: TestClient[Litestar], manager: CacheManager, checkpoint: Path
) -> None:
    """``model_name``: the path's last component, an alias once one names the checkpoint (the
    first by name), while ``model`` keeps the path; the dashboard shows ``model_name``."""
    bid = manager.prepare(str(checkpoint)).bundle_id

    def names() -> tuple[str, str, str, str]:
        item = client.get("/admin/bundles").json()["items"][0]
        per_model = client.get("/admin/stats").json()["per_model"]
        detail = client.get(f"/admin/bundles/{bid}").json()["bundle"]
        (stat,) = [m for m in per_model if m["model"] == str(checkpoint)]
        assert item["model"] == detail["model"] == str(checkpoint)
        return item["model_name"], stat["model_name"], detail["model_name"], item["id"]

    assert names() == (checkpoint.name, checkpoint.name, checkpoint.name, bid)
    assert client.put("/admin/models/zeta", json={"bundle_id": bid}).status_code == 200
    assert client.put("/admin/models/alpha", json={"model": str(checkpoint)}).status_code == 200
    assert names()[:3] == ("alpha", "alpha", "alpha")
    assert client.delete("/admin/models/alpha").status_code == 204
    assert client.put(f"/admin/bundles/{bid}/pin").json()["model_name"] == "zeta"
