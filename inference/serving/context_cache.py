"""Context reuse: KV of prompt prefixes kept as records keyed by chained block hashes.

A sequence's tokens are cut into blocks of ``block_tokens`` (64). Block ``i``'s key is
``blake2b(key[i-1] || tokens of block i)``, keyed with the store's namespace (the bundle id), so
a key names the whole prefix up to the end of its block and records of one model or bundle can
never match a lookup of another (each loaded engine has its own store besides). A request's
``cache_salt`` (vLLM's field) goes into the chain's seed too: records made with a salt are found
only by requests with the same salt, so tenants that do not share a salt cannot learn from the
time to first token whether another one sent a prompt. A record holds
that block's KV (an :meth:`KVEngine.export_kv` copy) and its tokens, checked on every hit.

Prompt tails: the tokens after a sequence's last complete block (1 to ``block_tokens - 1`` of
them) are kept too, as one *tail record* per chain position (key: the last complete block's key,
or the chain's seed, hashed apart), holding the tail's tokens and KV. After the last block a
lookup finds, it takes the longest common prefix of the tail record there and the prompt's rest,
so a prompt seen before prefills at most its last token instead of up to a block's worth (at 1,500
tokens of SmolLM2 on 2 cores, a 29-token tail cost ~4x a one-token step), and a conversation's
next turn reuses the previous turn's partial block. A newer tail at the same place replaces the
older one unless the older one extends it. A tail that ends where a prompt ended also keeps the
logits that followed it (handed on while the tail grows): the same prompt again is resumed whole,
with no prefill at all (:class:`Found`).

Limits: at most ``max_records`` records and ``max_bytes`` bytes of KV; the least recently used
record goes first. Lookups walk the chain from a given block and stop at the first miss, so a
hit always extends a prefix that is complete up to it.

On disk (``disk``, a :class:`~inference.serving.context_disk.DiskRecords`): every record inserted is also
queued for writing to the bundle's record directory, and a lookup that misses in memory reads the
block from there (checked, then kept in memory too), so records survive a restart; disk hits are
counted apart (``disk_hits``). A request's LoRA adapter seeds the chain too (:meth:`block_keys`),
so KV of one adapter never serves another.

Thread-safety: the scheduler thread owns the store; :meth:`stats` may be read from any thread
(it returns a copy taken under a lock); the disk store's writer thread updates its own figures.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from inference.serving.context_disk import DiskRecord, DiskRecords, DiskStats

log = logging.getLogger("inference.context_cache")

BLOCK_TOKENS = 64
#: What the pool-bytes flag's 0 ("no explicit bound") means for the KV records. Context reuse
#: is on by default, so this is memory every default server may take on top of its engine:
#: 512 MiB keeps a default server on a small shared machine (2 cores, 24 GiB) within a few GiB
#: (measured in the README) and still holds ~11k tokens of SmolLM2-135M prefixes (~2.9 MB per
#: 64-token block), ~21k of a 0.5B Qwen2.
DEFAULT_MAX_BYTES = 512 << 20


def record_pool_bytes(max_bytes: int) -> int:
    """The byte limit a store made with ``max_bytes`` keeps to (0: :data:`DEFAULT_MAX_BYTES`)."""
    return max_bytes or DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class ContextCacheStats:
    """Counters since start, and what the store holds now."""

    lookups: int = 0  # requests that looked for a cached prefix
    hits: int = 0  # of those, requests that resumed from one (slot or records)
    tokens_reused: int = 0  # prompt tokens not prefilled thanks to reuse
    record_hits: int = 0  # records copied back into a slot
    evictions: int = 0  # records dropped for the limits
    records: int = 0
    bytes: int = 0
    max_records: int = 0
    max_bytes: int = 0
    # The records on disk (all 0 without a disk store): blocks read back after a memory miss,
    # written, damaged ones dropped, evicted for the disk cap, not written (a full disk...), and
    # what the directory holds.
    disk_hits: int = 0
    disk_writes: int = 0
    disk_dropped: int = 0
    disk_evictions: int = 0
    disk_write_failures: int = 0
    disk_records: int = 0
    disk_bytes: int = 0
    disk_max_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """Plain dict for /health."""
        return dict(self.__dict__)


#: What :meth:`DiskRecords.read_records` gives for one key: the record, or None.
_DiskRead = DiskRecord | None


@dataclass(frozen=True)
class _Record:
    tokens: tuple[int, ...]
    kv: np.ndarray
    #: A prompt tail's: the logits that follow its first ``logits_at`` tokens (the prompt's end).
    logits: np.ndarray | None = None
    logits_at: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes) + (0 if self.logits is None else int(self.logits.nbytes))


class Found(list[np.ndarray]):
    """What :meth:`PrefixStore.fetch` found: KV records in order; ``logits`` when they cover the
    whole prompt, with the logits that follow it (no prefill needed, not even of its last
    token)."""

    logits: np.ndarray | None = None


class PrefixStore:
    """LRU store of per-block KV records; see the module docstring."""

    def __init__(self, namespace: str, *, max_records: int, max_bytes: int = 0,
                 block_tokens: int = BLOCK_TOKENS, disk: DiskRecords | None = None) -> None:
        """``max_bytes`` 0 means :data:`DEFAULT_MAX_BYTES`; ``disk`` keeps records across restarts.
        The LoRA adapter a block's KV was made with keys it per request (:meth:`block_keys`)."""
        if max_records < 0 or max_bytes < 0 or block_tokens < 1:
            raise ValueError("max_records and max_bytes must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self._salt = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._disk = disk
        # (shape, dtype) of the engine's blocks, once one was seen: a disk record of another
        # layout is dropped, never handed to the engine.
        self._layout: tuple[tuple[int, ...], np.dtype] | None = None
        self._records: OrderedDict[bytes, _Record] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = ContextCacheStats(max_records=max_records, max_bytes=record_pool_bytes(max_bytes))

    @property
    def disk(self) -> DiskRecords | None:
        """The records on disk, if any."""
        return self._disk

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` (any thread) after the disk writer changed the figures."""
        if self._disk is not None:
            self._disk.on_change = listener

    @property
    def max_records(self) -> int:
        """The record limit."""
        return self._stats.max_records

    @property
    def max_bytes(self) -> int:
        """The byte limit on held KV."""
        return self._stats.max_bytes

    def block_keys(self, tokens: Sequence[int], cache_salt: str | None = None,
                   adapter: str | None = None) -> list[bytes]:
        """Chained keys of the complete blocks of ``tokens``; ``cache_salt`` seeds the chain
        (None: the unsalted chain, shared by every request without a salt), and so does the LoRA
        ``adapter`` the KV is computed with (None: the base weights), so sequences of different
        adapters never share records."""
        keys: list[bytes] = []
        prev = self._seed(cache_salt, adapter)
        b = self.block_tokens
        arr = np.asarray(tokens, dtype=np.int64)
        for i in range(len(arr) // b):
            prev = hashlib.blake2b(prev + arr[i * b:(i + 1) * b].tobytes(), digest_size=20).digest()
            keys.append(prev)
        return keys

    def tail_key(self, keys: Sequence[bytes], cache_salt: str | None = None,
                 adapter: str | None = None) -> bytes:
        """The key of the tail record after the blocks ``keys`` (from :meth:`block_keys` with the
        same salt and adapter): it names the place, not the tail's tokens."""
        parent = keys[-1] if keys else self._seed(cache_salt, adapter)
        return hashlib.blake2b(parent, digest_size=20, person=b"prompt_tail").digest()

    def _seed(self, cache_salt: str | None, adapter: str | None) -> bytes:
        prev = self._salt
        if cache_salt is not None:
            # A separate person string keeps a salted seed from ever equalling a block key.
            prev = hashlib.blake2b(prev + cache_salt.encode("utf-8"), digest_size=16,
                                   person=b"cache_salt").digest()
        if adapter is not None:
            prev = hashlib.blake2b(prev + adapter.encode("utf-8"), digest_size=16,
                                   person=b"lora_adapter").digest()
        return prev

    def fetch(self, keys: Sequence[bytes], tokens: Sequence[int], held: int = 0, *, tails: bool = False,
              cache_salt: str | None = None, adapter: str | None = None,
              limit: int | None = None) -> Found:
        """KV to resume ``tokens`` from when its first ``held`` tokens are at hand already (a slot
        still holding them): the blocks from the one ``held`` falls in, up to the first miss
        (``keys`` from :meth:`block_keys` of ``tokens`` with ``cache_salt`` and ``adapter``).
        Hits become most recent.

        With ``tails``: then, after the last block found, the part of the tail record there that
        ``tokens[...:limit]`` starts with, if it adds to what the blocks and ``held`` give (its KV
        is shorter than a block on the token axis, ``shape[2]``); or, when that tail holds the
        rest of ``tokens`` whole and the logits that follow it, all of it and ``Found.logits``."""
        b = self.block_tokens
        found = Found()
        disk = self._disk
        ahead = self._read_ahead(keys, held // b, tails and (limit is None or limit > 0),
                                 cache_salt, adapter)
        end = len(keys)
        for i in range(held // b, len(keys)):
            block = tuple(int(t) for t in tokens[i * b:(i + 1) * b])
            rec = self._records.get(keys[i])
            if rec is not None and rec.tokens == block:
                self._records.move_to_end(keys[i])
                if disk is not None:
                    disk.touch(keys[i])
                found.append(rec.kv)
                continue
            kv = self._read_disk(keys[i], block, ahead) if rec is None else None
            if kv is None:
                end = i
                break
            self._keep(keys[i], _Record(block, kv))
            found.append(kv)
        rest = tokens[end * b:len(tokens) if limit is None else limit]
        if tails and rest and end >= held // b:
            part, logits = self._fetch_tail(self.tail_key(keys[:end], cache_salt, adapter), rest,
                                            tokens[end * b:], ahead)
            if part is not None and (found or end * b + part.shape[2] > held):
                found.append(part)
                found.logits = logits
        if found:
            self._update(record_hits=self._stats.record_hits + len(found))
        return found

    def _read_ahead(self, keys: Sequence[bytes], first: int, tail: bool, cache_salt: str | None,
                    adapter: str | None) -> dict[bytes, _DiskRead]:
        """Read at once the records a lookup from block ``first`` will want from disk: those not
        in memory up to the first block on neither, and the tail after them (``tail``)."""
        disk = self._disk
        if disk is None:
            return {}
        want: list[bytes] = []
        end = len(keys)
        for i in range(first, len(keys)):
            if keys[i] in self._records:
                continue
            if keys[i] not in disk:
                end = i
                break
            want.append(keys[i])
        if tail:
            key = self.tail_key(keys[:end], cache_salt, adapter)
            if key not in self._records and key in disk:
                want.append(key)
        return dict(zip(want, disk.read_records(want), strict=True))

    def _fetch_tail(self, key: bytes, rest: Sequence[int], whole: Sequence[int],
                    ahead: dict[bytes, _DiskRead]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The KV of the longest common prefix of tail record ``key`` and ``rest``, if any; or,
        when the record holds all of ``whole`` and the logits after it, that KV and those."""
        rec = self._records.get(key)
        if rec is None:
            rec = self._read_disk_tail(key, ahead)
            if rec is None:
                return None, None
            self._keep(key, rec)
        else:
            self._records.move_to_end(key)
            if self._disk is not None:
                self._disk.touch(key)
        if rec.logits is not None and rec.logits_at == len(whole) and rec.tokens[:len(whole)] == tuple(whole):
            n, logits = len(whole), rec.logits
        else:
            n, logits = common_prefix(rec.tokens, rest), None
        if n == 0:
            return None, None
        return (rec.kv if n == rec.kv.shape[2] else np.ascontiguousarray(rec.kv[:, :, :n])), logits

    def _read_disk_tail(self, key: bytes, ahead: dict[bytes, _DiskRead]) -> _Record | None:
        """Tail record ``key`` from disk (or ``ahead``) when it is there, whole, and a tail of this
        engine's layout."""
        def fits(got: DiskRecord) -> bool:
            kv = got.kv
            return (kv.ndim >= 3 and 0 < len(got.tokens) == kv.shape[2] < self.block_tokens
                    and (self._layout is None or (kv.shape[:2] + kv.shape[3:], kv.dtype)
                         == (self._layout[0][:2] + self._layout[0][3:], self._layout[1]))
                    and (got.logits is None or got.logits.ndim == 1))

        got = self._from_disk(key, ahead, fits)
        return None if got is None else _Record(got.tokens, got.kv, got.logits, got.logits_at)

    def _from_disk(self, key: bytes, ahead: dict[bytes, _DiskRead],
                   fits: Callable[[DiskRecord], bool]) -> DiskRecord | None:
        """Record ``key`` read ahead or now, counted as a disk hit if it ``fits`` the lookup;
        a file that does not is removed."""
        if self._disk is None:
            return None
        got = ahead[key] if key in ahead else self._disk.read_record(key, count=False)
        if got is None:
            return None
        if not fits(got):
            log.warning("context record %s does not fit this lookup (tokens or layout); removed", key.hex())
            self._disk.drop(key)
            return None
        self._disk.count_hits(1)
        return got

    def save_tail(self, key: bytes, tokens: Sequence[int], export: Callable[[], np.ndarray],
                  logits: np.ndarray | None = None) -> bool:
        """Keep ``tokens`` (shorter than a block) and their KV (``export()``, called only when
        needed) as the tail record ``key`` (:meth:`tail_key`), with ``logits`` (those that follow
        all of ``tokens``: a prompt's end) when given. An older tail there that starts with
        ``tokens`` is kept (it gains ``logits`` if it ends there too and had none); one that
        ``tokens`` extend is replaced but hands on its logits; any other is replaced. True when
        the record was (re)written."""
        tokens = tuple(int(t) for t in tokens)
        if not 0 < len(tokens) < self.block_tokens:
            raise ValueError(f"a tail holds 1 to {self.block_tokens - 1} tokens, not {len(tokens)}")
        old = self._records.get(key)
        at = len(tokens) if logits is not None else 0
        if old is not None and old.tokens[:len(tokens)] == tokens:
            self._records.move_to_end(key)
            if logits is None or old.logits is not None or len(old.tokens) != len(tokens):
                return False
            new = _Record(old.tokens, old.kv, logits, at)
        else:
            if logits is None and old is not None and old.logits is not None and (
                    tokens[:len(old.tokens)] == old.tokens):
                logits, at = old.logits, old.logits_at
            kv = export()
            if kv.ndim < 3 or kv.shape[2] != len(tokens):
                raise ValueError(f"tail KV of shape {kv.shape} does not hold {len(tokens)} tokens")
            new = _Record(tokens, kv, logits, at)
        if old is not None:
            del self._records[key]
            self._bytes -= old.nbytes
            self._update()
        if self._disk is not None:
            self._disk.put(key, new.tokens, new.kv, replace=True, logits=new.logits, logits_at=new.logits_at)
        return self._keep(key, new)

    def _read_disk(self, key: bytes, block: tuple[int, ...],
                   ahead: dict[bytes, _DiskRead]) -> np.ndarray | None:
        """Block ``key`` from disk (or ``ahead``) when it is there, whole, holds ``block`` and is
        of this engine's layout; a file that fails a check is removed."""
        def fits(got: DiskRecord) -> bool:
            kv = got.kv
            return (got.tokens == block and got.logits is None and kv.ndim >= 3
                    and kv.shape[2] == self.block_tokens
                    and (self._layout is None or (kv.shape, kv.dtype) == self._layout))

        got = self._from_disk(key, ahead, fits)
        if got is None:
            return None
        self._layout = (got.kv.shape, got.kv.dtype)
        return got.kv

    def close(self) -> None:
        """Write the queued records and stop the disk writer (memory records stay usable)."""
        if self._disk is not None:
            self._disk.close()

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def touch(self, key: bytes) -> bool:
        """Mark a record most recently used; False when there is none."""
        if key not in self._records:
            return False
        self._records.move_to_end(key)
        return True

    def insert(self, key: bytes, tokens: Sequence[int], kv: np.ndarray) -> bool:
        """Keep ``kv`` for block ``key``, evicting least recently used records to fit (and queue it
        for the disk store)."""
        if key in self._records:
            self._records.move_to_end(key)
            return True
        self._layout = (kv.shape, kv.dtype)
        if self._disk is not None:
            self._disk.put(key, tokens, kv)
        return self._keep(key, _Record(tuple(int(t) for t in tokens), kv))

    def _keep(self, key: bytes, record: _Record) -> bool:
        """Hold ``record`` in memory, evicting least recently used records to fit."""
        size = record.nbytes
        if self.max_records == 0 or size > self.max_bytes:
            return False
        evicted = 0
        while self._records and (
                len(self._records) >= self.max_records or self._bytes + size > self.max_bytes):
            _, old = self._records.popitem(last=False)
            self._bytes -= old.nbytes
            evicted += 1
        self._records[key] = record
        self._bytes += size
        self._update(evictions=self._stats.evictions + evicted)
        return True

    def note_lookup(self, reused: int) -> None:
        """Count one request's lookup and how many prompt tokens it did not prefill."""
        s = self._stats
        self._update(lookups=s.lookups + 1, hits=s.hits + (1 if reused else 0),
                     tokens_reused=s.tokens_reused + reused)

    def clear(self) -> None:
        """Drop every record."""
        self._records.clear()
        self._bytes = 0
        self._update()

    def _update(self, **changes: int) -> None:
        with self._lock:
            self._stats = replace(self._stats, records=len(self._records), bytes=self._bytes, **changes)

    def stats(self) -> ContextCacheStats:
        """A consistent snapshot of the counters (the disk's taken under its own lock)."""
        with self._lock:
            stats = self._stats
        if self._disk is None:
            return stats
        disk: DiskStats = self._disk.stats()
        return replace(stats, **disk.__dict__)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the common prefix of ``a`` and ``b`` (at most ``limit``)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), max(0, limit))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
