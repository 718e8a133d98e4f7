"""Two nodes, one catalog, one registry: node A builds and pushes (``--registry-push``), node B
serves the same bundle after a pull with no build; the fleet view says who pulled and who built."""

from __future__ import annotations

from pathlib import Path

from cachesvc.fleet.status import status_lines
from cachesvc.profiles import ProfileRequest
from tests.registry.conftest import Registry, fleet_catalog_url, open_node
from tests.support.cache import FileBuilder

INT4 = ProfileRequest(precision="int4")


def test_node_b_pulls_what_node_a_built_and_pushed(
    tmp_path: Path, catalog_db: str, registry: Registry, checkpoint: Path
) -> None:
    shared = fleet_catalog_url(tmp_path)
    a = open_node(tmp_path / "a", registry, push=True, catalog_url=shared, node="node-a")
    built = a.prepare(str(checkpoint), INT4)
    assert built.built
    builder_b = FileBuilder(files=3, file_size=4096)
    b = open_node(tmp_path / "b", registry, builder=builder_b, catalog_url=shared, node="node-b")
    got = b.prepare(str(checkpoint), INT4)
    assert got.pulled_from is not None and builder_b.calls == 0 and got.bundle_id == built.bundle_id
    assert b.verifier.verify(got.bundle_id).ok
    assert (got.bundle_dir / "part-000.bin").read_bytes() == (built.bundle_dir / "part-000.bin").read_bytes()

    nodes = {n.name: n for n in b.fleet.nodes()}
    assert (nodes["node-a"].pulled, nodes["node-a"].built) == (0, 1)
    assert (nodes["node-b"].pulled, nodes["node-b"].built) == (1, 0)
    lines = status_lines(list(nodes.values()))
    assert "PULLED/BUILT" in lines[0]
    assert any(line.startswith("node-b") and " 1/0 " in line for line in lines)
    # Per node, the whole catalog's stats split by node agree.
    assert b.queries.stats("node-b").pulls == 1 and b.queries.stats("node-a").pushes == 1
    a.close()
    b.close()
