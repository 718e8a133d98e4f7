"""Context-cache records on disk (``inference.serving.context_disk``) behind the prefix store: written by
a writer thread, found again by a new store on the same directory (a restart), damaged files
dropped, the byte cap held LRU across restarts, salts and adapters keep their records apart."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from inference.serving.context_cache import PrefixStore
from inference.serving.context_disk import DiskRecords, decode, encode

BLOCK = 64
SHAPE = (4, 2, BLOCK, 8)  # [2*layers, kv_heads, block, head_dim]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, size=n)]


def _kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _store(directory: Path, *, max_bytes: int = 1 << 20, salt_ns: str = "bundle:b1") -> PrefixStore:
    return PrefixStore(salt_ns, max_records=64, disk=DiskRecords(directory, max_bytes=max_bytes))


def _fill(store: PrefixStore, tokens: list[int], salt: str | None = None) -> list[np.ndarray]:
    """Insert every complete block of ``tokens`` as the scheduler does; the blocks' KV."""
    keys = store.block_keys(tokens, salt)
    kvs = [_kv(i + 100 * len(tokens)) for i in range(len(keys))]
    for i, key in enumerate(keys):
        assert store.insert(key, tokens[i * BLOCK:(i + 1) * BLOCK], kvs[i])
    disk = store.disk
    assert disk is not None
    disk.flush(timeout=30)
    return kvs


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"))


def test_records_survive_a_restart_and_count_as_disk_hits(tmp_path: Path) -> None:
    tokens = _tokens(3 * BLOCK + 10, 1)
    first = _store(tmp_path)
    kvs = _fill(first, tokens)
    stats = first.stats()
    assert stats.disk_writes == 3 and stats.disk_records == 3
    assert stats.disk_bytes == sum(p.stat().st_size for p in _files(tmp_path)) > 3 * kvs[0].nbytes
    first.close()
    assert not list(tmp_path.glob(".*.tmp"))

    again = _store(tmp_path)  # a restart: nothing in memory, the index rebuilt from the files
    assert again.stats().records == 0 and again.stats().disk_records == 3
    found = again.fetch(again.block_keys(tokens), tokens, 0)
    assert len(found) == 3
    for got, want in zip(found, kvs, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    stats = again.stats()
    assert stats.disk_hits == 3 and stats.record_hits == 3 and stats.records == 3
    # Kept in memory now: the next lookup is a memory hit, not a disk read.
    assert len(again.fetch(again.block_keys(tokens), tokens, 0)) == 3
    assert again.stats().disk_hits == 3
    # Nothing is written twice.
    _fill(again, tokens)
    assert again.stats().disk_writes == 0
    again.close()


def _written(tmp_path: Path, blocks: int, seed: int) -> tuple[list[int], list[np.ndarray], list[bytes]]:
    """``blocks`` blocks of tokens written to ``tmp_path`` by a store now closed: the tokens,
    the blocks' KV and keys."""
    tokens = _tokens(blocks * BLOCK, seed)
    first = _store(tmp_path)
    kvs = _fill(first, tokens)
    first.close()
    return tokens, kvs, first.block_keys(tokens)


def test_a_damaged_record_is_dropped_and_never_used(tmp_path: Path) -> None:
    tokens, kvs, keys = _written(tmp_path, 3, 2)
    middle = tmp_path / (keys[1].hex() + ".kv")
    data = bytearray(middle.read_bytes())
    data[-5] ^= 0x40  # one flipped bit in the KV payload
    middle.write_bytes(bytes(data))

    again = _store(tmp_path)
    found = again.fetch(keys, tokens, 0)
    assert len(found) == 1 and np.array_equal(found[0], kvs[0])  # the chain stops at the damage
    assert not middle.exists()
    stats = again.stats()
    assert stats.disk_dropped == 1 and stats.disk_records == 2 and stats.disk_hits == 1


@pytest.mark.parametrize("damage", ["truncated", "header", "renamed", "empty"])
def test_every_kind_of_damage_is_refused(tmp_path: Path, damage: str) -> None:
    tokens = _tokens(2 * BLOCK, 3)
    first = _store(tmp_path)
    _fill(first, tokens)
    first.close()
    keys = first.block_keys(tokens)
    path = tmp_path / (keys[0].hex() + ".kv")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        path.write_bytes(data[:8] + b"\x07" + data[9:])  # format version 7
    elif damage == "renamed":  # block 1's file under block 0's name: its key says otherwise
        (tmp_path / (keys[1].hex() + ".kv")).replace(path)
    else:
        path.write_bytes(b"")
    again = _store(tmp_path)
    assert again.fetch(keys, tokens, 0) == []
    assert not path.exists() and again.stats().disk_dropped == 1


def test_decode_checks_tokens_key_and_checksum() -> None:
    key = bytes(range(20))
    kv = _kv(4)
    toks = _tokens(BLOCK, 4)
    data = bytearray(b"".join(bytes(p) for p in encode(key, toks, kv)))
    got = decode(bytearray(data), key)
    assert list(got.tokens) == toks and np.array_equal(got.kv, kv) and got.logits is None
    with pytest.raises(ValueError, match="key"):
        decode(bytearray(data), bytes(20))
    logits = np.arange(7, dtype=np.float32)
    tail = decode(b"".join(bytes(p) for p in encode(key, toks[:9], kv[:, :, :9], logits, 9)), key)
    assert tail.logits_at == 9 and tail.logits is not None and np.array_equal(tail.logits, logits)
    with pytest.raises(ValueError, match="logits_at"):
        encode(key, toks[:9], kv[:, :, :9], logits, 10)
    data[130] ^= 1  # inside the token ids (after 128 bytes of header and digest)
    with pytest.raises(ValueError, match="checksum"):
        decode(data, key)


def test_the_cap_holds_lru_across_a_restart(tmp_path: Path) -> None:
    one = len(b"".join(bytes(p) for p in encode(bytes(20), _tokens(BLOCK, 0), _kv(0))))
    store = _store(tmp_path, max_bytes=3 * one)
    a, b, c, d = (_tokens(BLOCK, 10 + i) for i in range(4))
    for t in (a, b, c):
        _fill(store, t)
    assert store.stats().disk_records == 3
    time.sleep(0.02)  # mtimes apart
    assert store.fetch(store.block_keys(a), a, 0)  # a memory hit touches a's file too
    _fill(store, d)  # one over the cap: the least recently used (b) goes
    stats = store.stats()
    assert stats.disk_records == 3 and stats.disk_evictions == 1 and stats.disk_bytes <= 3 * one
    assert sum(p.stat().st_size for p in _files(tmp_path)) <= 3 * one
    assert store.block_keys(b)[0] not in store.disk  # type: ignore[operator]
    store.close()

    # The order survives the restart (file mtimes): a smaller cap keeps the two most recent.
    again = _store(tmp_path, max_bytes=2 * one)
    assert again.stats().disk_records == 2
    assert [len(again.fetch(again.block_keys(t), t, 0)) for t in (a, c, d)] == [1, 0, 1]


def test_salted_and_adapter_records_are_found_only_with_the_same_key(tmp_path: Path) -> None:
    tokens = _tokens(2 * BLOCK, 5)
    first = _store(tmp_path)
    _fill(first, tokens, salt="tenant-a")
    first.close()
    again = _store(tmp_path)
    assert again.fetch(again.block_keys(tokens), tokens, 0) == []  # no salt
    assert again.fetch(again.block_keys(tokens, "tenant-b"), tokens, 0) == []
    assert len(again.fetch(again.block_keys(tokens, "tenant-a"), tokens, 0)) == 2
    # Another bundle, or the same bundle with an adapter, never finds them.
    assert _store(tmp_path, salt_ns="bundle:b2").fetch(
        _store(tmp_path, salt_ns="bundle:b2").block_keys(tokens, "tenant-a"), tokens, 0) == []
    assert again.fetch(again.block_keys(tokens, "tenant-a", "lora-1"), tokens, 0) == []
    # No adapter: the chain is exactly the one without the parameter.
    assert again.block_keys(tokens, "tenant-a", None) == again.block_keys(tokens, "tenant-a")


def test_a_record_of_another_layout_is_dropped(tmp_path: Path) -> None:
    tokens = _tokens(2 * BLOCK, 6)
    store = _store(tmp_path)
    keys = store.block_keys(tokens)
    store.insert(keys[0], tokens[:BLOCK], _kv(1))
    disk = store.disk
    assert disk is not None
    disk.put(keys[1], tokens[BLOCK:], _kv(2)[:, :1])  # one kv head: not this engine's blocks
    disk.flush(timeout=30)
    store.close()
    again = _store(tmp_path)
    again.insert(keys[0], tokens[:BLOCK], _kv(1))  # the engine's layout is known from here on
    assert len(again.fetch(keys, tokens, 0)) == 1
    assert again.stats().disk_dropped == 1


def test_writes_never_block_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskRecords(tmp_path, max_bytes=1 << 30, queue_size=2)
    gate = threading.Event()
    real = disk._write

    def slow(*args: object) -> None:
        gate.wait(30)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk, "_write", slow)
    tokens = _tokens(BLOCK, 7)
    started = time.monotonic()
    queued = [disk.put(bytes([i]) * 20, tokens, _kv(i)) for i in range(6)]
    assert time.monotonic() - started < 1.0
    # Two fit the queue (a third when the writer already took one); then skipped, not waited for.
    assert queued[:2] == [True, True] and sum(queued) <= 3 and not queued[-1]
    gate.set()
    disk.close()
    assert len(_files(tmp_path)) == sum(queued)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities: Linux")
def test_the_writer_thread_runs_at_the_lowest_cpu_priority(tmp_path: Path) -> None:
    # The writer hashes and copies whole blocks; at nice 19 it takes what the engine's threads
    # leave (the scheduler and this thread keep their own priority: only the writer yields).
    before = os.getpriority(os.PRIO_PROCESS, 0)
    disk = DiskRecords(tmp_path, max_bytes=1 << 30)
    seen: dict[str, int] = {}
    real = disk._write

    def noting(*args: object) -> None:
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # this thread's nice
        real(*args)  # type: ignore[arg-type]

    disk._write = noting  # type: ignore[method-assign,assignment]
    assert disk.put(b"\x01" * 20, _tokens(BLOCK, 3), _kv(3))
    disk.close()
    assert seen == {"writer": 19}
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_temp_files_of_a_crash_are_removed_at_open(tmp_path: Path) -> None:
    (tmp_path / ".abc.kv.123.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("kept")
    disk = DiskRecords(tmp_path)
    assert not (tmp_path / ".abc.kv.123.tmp").exists() and (tmp_path / "notes.txt").exists()
    assert disk.stats().disk_records == 0
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_the_directory_is_made_on_the_first_write(tmp_path: Path) -> None:
    directory = tmp_path / "context" / "b1"
    disk = DiskRecords(directory, dir_mode=0o750)
    assert not (tmp_path / "context").exists()  # a server that never writes leaves nothing
    assert disk.put(bytes(20), _tokens(BLOCK, 8), _kv(8))
    disk.close()
    assert len(_files(directory)) == 1
    assert (directory.stat().st_mode & 0o777) == (directory.parent.stat().st_mode & 0o777) == 0o750



def test_the_owners_guard_keeps_everything_out_of_a_refused_folder(tmp_path: Path) -> None:
    """The guard (the cache's: no link) is asked at open and before every write or removal: a
    folder swapped for a link while serving gets nothing written or deleted through it."""
    folder, target = tmp_path / "records", tmp_path / "target"
    target.mkdir()

    def guard() -> None:
        if folder.is_symlink():
            raise RuntimeError(f"{folder} is a symlink")

    disk = DiskRecords(folder, guard=guard)
    tokens = _tokens(BLOCK, 9)
    assert disk.put(bytes(20), tokens, _kv(9))
    disk.flush(timeout=30)
    assert disk.stats().disk_writes == 1
    folder.rename(tmp_path / "moved")
    folder.symlink_to(target, target_is_directory=True)
    kept = target / (bytes(20).hex() + ".kv")
    kept.write_bytes(b"someone's file")  # named like the record: a removal must not reach it
    assert disk.put(bytes([1]) * 20, tokens, _kv(10))
    disk.flush(timeout=30)
    disk.drop(bytes(20))
    disk.close()
    stats = disk.stats()
    assert stats.disk_write_failures == 1 and stats.disk_writes == 1 and stats.disk_records == 0
    assert sorted(os.listdir(target)) == [kept.name] and kept.read_bytes() == b"someone's file"
    with pytest.raises(RuntimeError, match="is a symlink"):
        DiskRecords(folder, guard=guard)
    assert sorted(os.listdir(target)) == [kept.name]

def _tail_kv(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((SHAPE[0], SHAPE[1], n, SHAPE[3])).astype(np.float32)


def test_a_prompt_tail_is_found_again_after_a_restart_up_to_where_the_prompt_differs(tmp_path: Path) -> None:
    tokens = _tokens(2 * BLOCK + 20, 7)
    first = _store(tmp_path)
    _fill(first, tokens)
    keys = first.block_keys(tokens)
    tail = first.tail_key(keys)
    assert tail not in keys and first.tail_key(keys, "salt") == tail  # keys[-1] carries the salt
    kv = _tail_kv(20, 1)
    assert first.save_tail(tail, tokens[2 * BLOCK:], lambda: kv)
    first.close()

    again = _store(tmp_path)
    found = again.fetch(keys, tokens, 0, tails=True, limit=len(tokens) - 1)
    assert [f.shape[2] for f in found] == [BLOCK, BLOCK, 19]  # the last token is left to prefill
    assert np.array_equal(found[2], kv[:, :, :19])
    assert again.stats().disk_hits == 3
    other = [*tokens[: 2 * BLOCK + 5], *(t + 1 for t in tokens[2 * BLOCK + 5:])]
    found = again.fetch(keys, other, 0, tails=True)
    assert [f.shape[2] for f in found] == [BLOCK, BLOCK, 5]  # the common prefix of tail and prompt
    assert again.fetch(keys, tokens, 2 * BLOCK + 19, tails=True, limit=len(tokens) - 1) == []  # held
    # A chain that breaks after its first block: the tail there (none) is looked for, not this one.
    broken = [*tokens[:BLOCK], *(t + 1 for t in tokens[BLOCK:])]
    assert len(again.fetch(again.block_keys(broken), broken, 0, tails=True)) == 1


def test_a_newer_tail_replaces_an_older_one_unless_that_one_extends_it(tmp_path: Path) -> None:
    tokens = _tokens(BLOCK + 30, 8)
    store = _store(tmp_path)
    keys = store.block_keys(tokens)
    tail = store.tail_key(keys)
    calls: list[int] = []

    def export(n: int, seed: int) -> np.ndarray:
        calls.append(n)
        return _tail_kv(n, seed)

    assert store.save_tail(tail, tokens[BLOCK:BLOCK + 10], lambda: export(10, 1))
    assert store.save_tail(tail, tokens[BLOCK:], lambda: export(30, 2))  # grew: replaced
    assert not store.save_tail(tail, tokens[BLOCK:BLOCK + 10], lambda: export(10, 3))  # kept, no export
    assert calls == [10, 30]
    other = [*tokens[BLOCK:BLOCK + 5], *_tokens(7, 9)]
    assert store.save_tail(tail, other, lambda: export(12, 4))  # diverged: the newer wins
    assert store.stats().records == 1 and store.stats().bytes == _tail_kv(12, 0).nbytes
    with pytest.raises(ValueError, match="1 to 63 tokens"):
        store.save_tail(tail, tokens[:BLOCK], lambda: export(BLOCK, 5))
    disk = store.disk
    assert disk is not None
    disk.flush(timeout=30)
    store.close()
    assert len(_files(tmp_path)) == 1 and store.stats().disk_writes == 3  # one file, rewritten whole
    again = _store(tmp_path)
    found = again.fetch(keys, [*tokens[:BLOCK], *other], BLOCK, tails=True)
    assert len(found) == 1 and np.array_equal(found[0], _tail_kv(12, 4))


def _one_block_and_a_tail(
    tmp_path: Path, n: int, seed: int
) -> tuple[PrefixStore, list[int], list[bytes], bytes]:
    """A store on ``tmp_path`` holding the first block of ``n`` tokens; its keys and tail key."""
    tokens = _tokens(n, seed)
    store = _store(tmp_path)
    keys = store.block_keys(tokens)
    _fill(store, tokens)
    return store, tokens, keys, store.tail_key(keys)


def test_a_damaged_or_misshapen_tail_is_dropped(tmp_path: Path) -> None:
    store, tokens, keys, tail = _one_block_and_a_tail(tmp_path, BLOCK + 30, 10)
    disk = store.disk
    assert disk is not None
    disk.put(tail, tokens[BLOCK:], _tail_kv(29, 1))  # 30 tokens, KV of 29: not a tail
    disk.flush(timeout=30)
    store.close()
    again = _store(tmp_path)
    assert len(again.fetch(keys, tokens, 0, tails=True)) == 1
    assert again.stats().disk_dropped == 1 and not (tmp_path / (tail.hex() + ".kv")).exists()

    again.save_tail(tail, tokens[BLOCK:], lambda: _tail_kv(30, 2))
    assert again.disk is not None
    again.disk.flush(timeout=30)
    again.close()
    path = tmp_path / (tail.hex() + ".kv")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    third = _store(tmp_path)
    assert len(third.fetch(keys, tokens, 0, tails=True)) == 1 and not path.exists()
    assert third.stats().disk_dropped == 1


def test_a_lookup_reads_its_records_at_once_and_counts_only_those_it_uses(tmp_path: Path) -> None:
    tokens, kvs, keys = _written(tmp_path, 4, 11)
    (tmp_path / (keys[2].hex() + ".kv")).write_bytes(b"damaged")
    again = _store(tmp_path)
    found = again.fetch(keys, tokens, 0)
    assert [np.array_equal(f, k) for f, k in zip(found, kvs, strict=False)] == [True, True]
    stats = again.stats()
    # The fourth was read with the others, whole, but the chain stopped before it: not a hit.
    assert stats.disk_hits == 2 and stats.disk_dropped == 1 and stats.disk_records == 3
    again.close()  # memory records stay usable; a later disk read goes one file at a time
    assert len(_store(tmp_path).fetch(keys[:2], tokens, 0)) == 2
    later = _store(tmp_path)
    later.close()
    assert len(later.fetch(keys[:2], tokens, 0)) == 2


def test_a_tail_keeps_the_logits_after_its_prompt_while_it_grows(tmp_path: Path) -> None:
    store, tokens, keys, tail = _one_block_and_a_tail(tmp_path, BLOCK + 40, 12)
    logits = np.arange(5, dtype=np.float32)
    prompt = [*tokens[:BLOCK + 20]]
    assert store.save_tail(tail, prompt[BLOCK:], lambda: _tail_kv(20, 1), logits=logits)
    # The answer's tokens extend the tail: replaced, and the prompt's logits handed on.
    assert store.save_tail(tail, tokens[BLOCK:], lambda: _tail_kv(40, 2))
    found = store.fetch(keys, prompt, 0, tails=True, limit=len(prompt) - 1)
    assert [f.shape[2] for f in found] == [BLOCK, 20] and np.array_equal(found.logits, logits)  # type: ignore[arg-type]
    assert np.array_equal(found[1], _tail_kv(40, 2)[:, :, :20])
    # A prompt that stops elsewhere in the tail gets no logits: all but its last token, as before.
    shorter = prompt[:-3]
    found = store.fetch(keys, shorter, 0, tails=True, limit=len(shorter) - 1)
    assert [f.shape[2] for f in found] == [BLOCK, 16] and found.logits is None
    # After a restart too.
    assert store.disk is not None
    store.disk.flush(timeout=30)
    store.close()
    again = _store(tmp_path)
    found = again.fetch(keys, prompt, 0, tails=True, limit=len(prompt) - 1)
    assert [f.shape[2] for f in found] == [BLOCK, 20] and np.array_equal(found.logits, logits)  # type: ignore[arg-type]
    # A tail that diverges replaces it, and the old prompt's logits go with it.
    other = [*prompt[:BLOCK + 5], *_tokens(10, 13)]
    assert again.save_tail(tail, other[BLOCK:], lambda: _tail_kv(15, 3))
    found = again.fetch(keys, prompt, 0, tails=True, limit=len(prompt) - 1)
    assert [f.shape[2] for f in found] == [BLOCK, 5] and found.logits is None


def test_records_of_another_format_are_removed_at_open(tmp_path: Path) -> None:
    tokens, _kvs, keys = _written(tmp_path, 2, 14)
    old = tmp_path / (keys[1].hex() + ".kv")
    data = bytearray(old.read_bytes())
    data[8:12] = (1).to_bytes(4, "little")  # format version 1: no logits field in its header
    old.write_bytes(bytes(data))
    (tmp_path / ("ab" * 20 + ".kv")).write_bytes(b"")  # named like a record, not one
    store = _store(tmp_path)
    stats = store.stats()
    assert stats.disk_dropped == 2 and stats.disk_records == 1 and len(_files(tmp_path)) == 1
    assert len(store.fetch(keys, tokens, 0)) == 1
