"""Basic auth (htpasswd) on a real registry: credentials come from the Docker config file;
none, or wrong ones, get one clear line (401) and nothing changes."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import RegistryAuthError
from tests.registry.conftest import PASSWORD, USER, Registry, open_node

INT4 = ProfileRequest(precision="int4")


def _docker_config(folder: Path, host: str, user: str, password: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (folder / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return folder


def test_credentials_from_the_docker_config_file(
    tmp_path: Path, auth_registry: Registry, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no credentials of the machine's own
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    a = open_node(tmp_path / "node-a", auth_registry)
    bid = a.prepare(str(checkpoint), INT4).bundle_id
    with pytest.raises(RegistryAuthError) as info:
        a.registry.push(bid)
    assert "wants credentials (401)" in str(info.value) and "docker login" in str(info.value)

    monkeypatch.setenv(
        "DOCKER_CONFIG", str(_docker_config(tmp_path / "wrong", auth_registry.host, USER, "nope"))
    )
    with pytest.raises(RegistryAuthError, match="401"):
        a.registry.push(bid)
    assert not auth_registry.blobs()

    monkeypatch.setenv(
        "DOCKER_CONFIG", str(_docker_config(tmp_path / "right", auth_registry.host, USER, PASSWORD))
    )
    a.registry.push(bid)
    b = open_node(tmp_path / "node-b", auth_registry)
    pulled = b.pull(str(checkpoint), INT4)
    assert pulled.bundle_id == bid and b.verifier.verify(bid).ok
    a.close()
    b.close()
