"""Nothing is ever deleted through a link, the context records' folder included: a real
``cachesvc serve`` whose ``context/<bundle_id>`` is a symlink does not use it (that bundle's
records stay in memory, one warning saying why and what to do) and leaves the link's target as
it was: its ``*.tmp`` and record-named files are not deleted, no record is written there."""

from __future__ import annotations

from pathlib import Path

from tests.service.conftest import MODEL, running_server, serve_args

PROFILE = serve_args(max_input_len=256, max_kv_cache_capacity=512)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # several 64-token blocks


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_linked_record_folder_is_not_used_and_its_target_not_touched(
        demo_dir: Path, tmp_path: Path) -> None:
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    with running_server(demo_dir, cache, logs, *PROFILE) as server:
        bid = server.bundle_id()
    target = tmp_path / "elsewhere"
    target.mkdir()
    # What the store would delete at open in its own folder: a temp file and a file named like a
    # record that is not one (another format); and a file of the target's owner.
    (target / ".0123.tmp").write_bytes(b"someone's temp file")
    (target / ("ab" * 20 + ".kv")).write_bytes(b"not a record, someone's file")
    (target / "notes.txt").write_text("keep me")
    before = _snapshot(target)
    folder = cache / "context" / bid
    folder.parent.mkdir(exist_ok=True)
    folder.symlink_to(target, target_is_directory=True)

    with running_server(demo_dir, cache, logs, *PROFILE) as server:
        client = server.client()
        texts = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
                 .choices[0].text for _ in range(3)]
        stats = server.health()["context_cache"]
        log_path = server.log_path
    assert _snapshot(target) == before  # nothing deleted, written or touched there
    assert folder.is_symlink()
    # Context reuse goes on in memory; the disk side is off for this bundle.
    assert texts[0] == texts[1] == texts[2]
    assert stats["hits"] >= 2 and stats["disk_max_bytes"] == 0 and stats["disk_writes"] == 0, stats
    warnings = [line for line in log_path.read_text().splitlines() if "stay in memory only" in line]
    assert len(warnings) == 1, warnings
    assert bid in warnings[0] and "Replace it with a real directory" in warnings[0], warnings

