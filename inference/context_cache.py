"""Context reuse: KV of prompt prefixes kept as records keyed by chained block hashes.

A sequence's tokens are cut into blocks of ``block_tokens`` (64). Block ``i``'s key is
``blake2b(key[i-1] || tokens of block i)``, keyed with the store's namespace (the bundle id), so
a key names the whole prefix up to the end of its block and records of one model or bundle can
never match a lookup of another (each loaded engine has its own store besides). A request's
``cache_salt`` (vLLM's field) goes into the chain's seed too: records made with a salt are found
only by requests with the same salt, so tenants that do not share a salt cannot learn from the
time to first token whether another one sent a prompt. A record holds
that block's KV (an :meth:`KVEngine.export_kv` copy) and its tokens, checked on every hit.

Limits: at most ``max_records`` records and ``max_bytes`` bytes of KV; the least recently used
record goes first. Lookups walk the chain from a given block and stop at the first miss, so a
hit always extends a prefix that is complete up to it.

Thread-safety: the scheduler thread owns the store; :meth:`stats` may be read from any thread
(it returns a copy taken under a lock).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

BLOCK_TOKENS = 64
#: What the pool-bytes flag's 0 ("no explicit bound") means for the KV records. Context reuse
#: is on by default, so this is memory every default server may take on top of its engine:
#: 512 MiB keeps a default server on a small shared machine (2 cores, 24 GiB) within a few GiB
#: (measured in the README) and still holds ~11k tokens of SmolLM2-135M prefixes (~2.9 MB per
#: 64-token block), ~21k of a 0.5B Qwen2.
DEFAULT_MAX_BYTES = 512 << 20


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

    def as_dict(self) -> dict[str, int]:
        """Plain dict for /health."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Record:
    tokens: tuple[int, ...]
    kv: np.ndarray


class PrefixStore:
    """LRU store of per-block KV records; see the module docstring."""

    def __init__(self, namespace: str, *, max_records: int, max_bytes: int = 0,
                 block_tokens: int = BLOCK_TOKENS) -> None:
        """``max_bytes`` 0 means :data:`DEFAULT_MAX_BYTES`."""
        if max_records < 0 or max_bytes < 0 or block_tokens < 1:
            raise ValueError("max_records and max_bytes must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self._salt = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._records: OrderedDict[bytes, _Record] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = ContextCacheStats(max_records=max_records, max_bytes=max_bytes or DEFAULT_MAX_BYTES)

    @property
    def max_records(self) -> int:
        """The record limit."""
        return self._stats.max_records

    @property
    def max_bytes(self) -> int:
        """The byte limit on held KV."""
        return self._stats.max_bytes

    def block_keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chained keys of the complete blocks of ``tokens``; ``cache_salt`` seeds the chain
        (None: the unsalted chain, shared by every request without a salt)."""
        keys: list[bytes] = []
        prev = self._salt
        if cache_salt is not None:
            # A separate person string keeps a salted seed from ever equalling a block key.
            prev = hashlib.blake2b(prev + cache_salt.encode("utf-8"), digest_size=16,
                                   person=b"cache_salt").digest()
        b = self.block_tokens
        arr = np.asarray(tokens, dtype=np.int64)
        for i in range(len(arr) // b):
            prev = hashlib.blake2b(prev + arr[i * b:(i + 1) * b].tobytes(), digest_size=20).digest()
            keys.append(prev)
        return keys

    def fetch(self, keys: Sequence[bytes], tokens: Sequence[int], first_block: int) -> list[np.ndarray]:
        """KV of the blocks ``first_block, first_block+1, ...`` of ``tokens`` held here, up to the
        first miss (``keys`` from :meth:`block_keys` of ``tokens``). Hits become most recent."""
        b = self.block_tokens
        found: list[np.ndarray] = []
        for i in range(first_block, len(keys)):
            rec = self._records.get(keys[i])
            if rec is None or rec.tokens != tuple(tokens[i * b:(i + 1) * b]):
                break
            self._records.move_to_end(keys[i])
            found.append(rec.kv)
        if found:
            self._update(record_hits=self._stats.record_hits + len(found))
        return found

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def touch(self, key: bytes) -> bool:
        """Mark a record most recently used; False when there is none."""
        if key not in self._records:
            return False
        self._records.move_to_end(key)
        return True

    def insert(self, key: bytes, tokens: Sequence[int], kv: np.ndarray) -> bool:
        """Keep ``kv`` for block ``key``, evicting least recently used records to fit."""
        if key in self._records:
            self._records.move_to_end(key)
            return True
        size = int(kv.nbytes)
        if self.max_records == 0 or size > self.max_bytes:
            return False
        evicted = 0
        while self._records and (
                len(self._records) >= self.max_records or self._bytes + size > self.max_bytes):
            _, old = self._records.popitem(last=False)
            self._bytes -= int(old.kv.nbytes)
            evicted += 1
        self._records[key] = _Record(tuple(int(t) for t in tokens), kv)
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
        """A consistent snapshot of the counters."""
        with self._lock:
            return self._stats
