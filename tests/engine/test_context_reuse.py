"""Context reuse through the scheduler on real engines: the same greedy tokens with and without
reuse (sequential, concurrent, mixed lengths, chunked), LRU at the record limit, namespacing,
the per-request opt-out and the byte bound over a long run."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.runtime import load_engine
from inference.serving.context_cache import PrefixStore
from inference.serving.generation import GenerationState
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.scheduler import GenerationRequest, Scheduler, _Running
from tests.support.scheduling import CollectingSink, IdTokens

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
BLOCK_BYTES = 2 * 2 * 2 * 64 * 16 * 4  # K+V, 2 layers, 2 kv heads, 64 positions, head_dim 16, fp32


class _Runner:
    def __init__(self, engine: Any, store: PrefixStore | None, *, batch: int, chunk: int = 32,
                 save_delay: float = 0.5) -> None:
        self.engine = engine
        self.sched = Scheduler(
            engine,
            max_batch_size=batch,
            max_queued_requests=256,
            queue_timeout=120,
            prefill_chunk=chunk,
            context_cache=store,
            save_delay=save_delay,
        )
        self.sched.start()

    def submit(self, prompt: list[int], steps: int, cache_prompt: bool = True,
               cache_salt: str | None = None) -> CollectingSink:
        sink = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=prompt, max_new_tokens=steps)  # type: ignore[arg-type]
        sampler = Sampler(SamplingParams(temperature=0.0), self.engine.info.vocab_size)
        self.sched.submit(GenerationRequest(prompt, sampler, state, sink, cache_prompt=cache_prompt,
                                            cache_salt=cache_salt))
        return sink

    def settle(self, timeout: float = 30.0) -> None:
        """Until the records of finished requests are made (the scheduler saves them when idle)."""
        deadline = time.monotonic() + timeout
        while self.sched.pending_record_saves and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not self.sched.pending_record_saves, "records still pending after the idle delay"

    def one_by_one(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        return [self.submit(p, steps).tokens() for p in prompts]

    def together(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        sinks = [self.submit(p, steps) for p in prompts]
        return [s.tokens() for s in sinks]

    def stop(self) -> None:
        self.sched.stop()


def _rand(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=n)]


@pytest.fixture(scope="module")
def bundle(hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]) -> Callable[[str], Path]:
    def make(family: str) -> Path:
        return built_bundle(
            hf_checkpoint(family, "fp32", family == "qwen3"), max_batch_size=8, max_kv_cache_capacity=512
        )

    return make


def _conversation() -> list[list[int]]:
    """Prompts sharing prefixes the way chat and RAG traffic do."""
    system = _rand(150, 1)
    a, b = [*system, *_rand(20, 2)], [*system, *_rand(45, 3)]
    return [a, b, a, [*a, *_rand(70, 4)], _rand(9, 5), [*system[:64], *_rand(3, 6)], b, system]


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_gives_the_same_greedy_tokens(
    family: str,
    bundle: Callable[[str], Path],
    hf_checkpoint: Callable[..., Path],
    reference: Callable[[Path], Any],
    greedy_reference: Callable[..., tuple[list[int], list[np.ndarray]]],
) -> None:
    prompts = _conversation()
    cold = _Runner(load_engine(bundle(family), threads=1), None, batch=1)
    want = cold.one_by_one(prompts, 10)
    cold.stop()
    ref = reference(hf_checkpoint(family, "fp32", family == "qwen3"))
    assert [want[i] for i in (1, 3)] == [greedy_reference(ref, prompts[i], 10)[0] for i in (1, 3)]
    store = PrefixStore("test", max_records=64)
    warm = _Runner(load_engine(bundle(family), threads=1), store, batch=2)
    assert warm.one_by_one(prompts, 10) == want
    # Concurrently too: 8 mixed-length requests at once, prefill interleaved with decode.
    assert warm.together(prompts, 10) == want
    warm.stop()
    stats = store.stats()
    assert stats.hits >= 6 and stats.tokens_reused > 1000 and stats.record_hits > 0


def test_batch_8_concurrent_mixed_lengths_match_batch_1(bundle: Callable[[str], Path]) -> None:
    prompts = [_rand(n, 40 + n) for n in (1, 5, 64, 65, 130, 200, 17, 300)]
    one = _Runner(load_engine(bundle("llama"), threads=1), None, batch=1, chunk=48)
    want = one.one_by_one(prompts, 12)
    one.stop()
    eight = _Runner(load_engine(bundle("llama"), threads=1), None, batch=8, chunk=48)
    assert eight.together(prompts, 12) == want
    eight.stop()


def test_lru_keeps_a_used_prefix_and_evicts_at_the_record_limit(bundle: Callable[[str], Path]) -> None:
    # Each request leaves its complete blocks and one tail record (its partial last block).
    store = PrefixStore("test", max_records=6)
    runner = _Runner(load_engine(bundle("qwen2"), threads=1), store, batch=1, save_delay=0.0)
    first = _rand(140, 7)  # two full blocks and a tail
    want = runner.submit(first, 4).tokens()
    runner.settle()
    keys = store.block_keys(first)
    kept = [*keys, store.tail_key(keys)]
    assert all(k in store for k in kept) and store.stats().records == 3
    other = _rand(70, 8)
    runner.submit(other, 4).tokens()  # one block and a tail more: 5 records, first's kept
    runner.settle()
    assert store.stats().records == 5 and all(k in store for k in kept)
    before = store.stats().tokens_reused
    assert runner.submit(first, 4).tokens() == want  # the slot was overwritten: records serve it
    runner.settle()
    # The whole prompt, blocks and tail; the tail kept the logits after it: nothing prefilled.
    assert store.stats().tokens_reused - before == 140
    runner.submit(_rand(70, 9), 4).tokens()  # 7 records seen, limit 6: the least recent goes
    runner.settle()
    assert store.stats().records == 6 and store.stats().evictions == 1
    assert store.block_keys(other)[0] not in store and all(k in store for k in kept)
    runner.submit(_rand(70, 10), 4).tokens()  # two more out: other's tail, then first's first block
    runner.settle()
    assert keys[0] not in store and store.stats().evictions == 3
    before = store.stats().tokens_reused
    assert runner.submit(first, 4).tokens() == want
    assert store.stats().tokens_reused == before  # a chain without its first block is no prefix
    runner.stop()


def test_the_next_turn_resumes_from_the_previous_turns_partial_block(bundle: Callable[[str], Path]) -> None:
    """A tail record (the partial last block) serves the next turn, which extends the sequence,
    and a repeat of the same prompt, which then prefills one token; same greedy tokens as cold."""
    turn1 = _rand(100, 31)
    cold = _Runner(load_engine(bundle("llama"), threads=1), None, batch=1)
    answer = cold.submit(turn1, 8).tokens()
    turn2 = [*turn1, *answer[:7], *_rand(30, 32)]  # the slot held turn 1 and 7 fed-back tokens
    want = cold.one_by_one([turn2, turn1], 8)
    cold.stop()
    store = PrefixStore("test", max_records=16)
    warm = _Runner(load_engine(bundle("llama"), threads=1), store, batch=1)
    assert warm.submit(turn1, 8).tokens() == answer
    warm.submit(_rand(50, 33), 2).tokens()  # another prompt takes the slot: records must serve
    before = store.stats()
    assert warm.submit(turn2, 8).tokens() == want[0]
    assert store.stats().tokens_reused - before.tokens_reused == 107  # 64 of a block, 43 of a tail
    warm.submit(_rand(50, 34), 2).tokens()
    before = store.stats()
    assert warm.submit(turn1, 8).tokens() == want[1]
    assert store.stats().tokens_reused - before.tokens_reused == 100  # all, with its logits
    warm.stop()


def test_a_repeated_prompt_is_answered_without_a_prefill(bundle: Callable[[str], Path]) -> None:
    """The tail record after a prompt keeps the logits that follow it: the same prompt again is
    resumed whole and sampled from them, with no engine run before its first token."""
    prompt = _rand(90, 35)
    cold = _Runner(load_engine(bundle("qwen3"), threads=1), None, batch=1)
    want = cold.submit(prompt, 6).tokens()
    cold.stop()
    store = PrefixStore("test", max_records=16)
    engine = load_engine(bundle("qwen3"), threads=1)
    calls: list[int] = []
    prefill = engine.prefill

    def counted(slot: int, ids: Sequence[int]) -> np.ndarray:
        calls.append(len(ids))
        return prefill(slot, ids)

    engine.prefill = counted  # type: ignore[method-assign,assignment]  # counts the runs
    warm = _Runner(engine, store, batch=1)
    assert warm.submit(prompt, 6).tokens() == want
    assert calls == [32, 32, 26]  # cold: the whole prompt, in chunks
    warm.submit(_rand(40, 36), 1).tokens()  # another prompt takes the slot
    calls.clear()
    before = store.stats().tokens_reused
    assert warm.submit(prompt, 6).tokens() == want
    assert calls == [] and store.stats().tokens_reused - before == 90
    warm.stop()


def test_a_follow_up_in_the_same_slot_does_not_wait_for_the_records(bundle: Callable[[str], Path]) -> None:
    """A request that ends at its first token leaves its blocks to be saved when the scheduler is
    idle: a follow-up that extends its prompt in the same slot is prefilled before any of them is
    copied (the copy was 100-190 ms of a seen 1,500-token prefix's time to first token on
    SmolLM2), answers as cold, and the records of both are there once the scheduler is idle."""
    base = _rand(150, 41)  # two full blocks and a tail
    follow = [*base, *_rand(8, 42)]
    cold = _Runner(load_engine(bundle("llama"), threads=1), None, batch=1)
    want = cold.submit(follow, 4).tokens()
    cold.stop()
    store = PrefixStore("test", max_records=16)
    engine: Any = load_engine(bundle("llama"), threads=1)
    events: list[str] = []
    prefill, export = engine.prefill, engine.export_kv

    def logged_prefill(slot: int, ids: Sequence[int]) -> np.ndarray:
        events.append(f"prefill {len(ids)}")
        return prefill(slot, ids)

    def logged_export(slot: int, start: int, length: int) -> np.ndarray:
        events.append(f"export {start}")
        return export(slot, start, length)

    engine.prefill = logged_prefill
    engine.export_kv = logged_export
    runner = _Runner(engine, store, batch=1, save_delay=30.0)  # idle saves far off: the order shows
    runner.submit(base, 1).tokens()
    assert not any(e.startswith("export") for e in events)  # nothing copied yet: kept for idle
    events.clear()
    assert runner.submit(follow, 4).tokens() == want
    assert events[0] == "prefill 8", events  # the follow-up first, from the slot's own KV
    runner.stop()  # a stop saves what is pending too: the follow-up's tail
    assert not store_keys_missing(store, base) and not store_keys_missing(store, follow)
    quick_store = PrefixStore("test", max_records=16)
    quick = _Runner(load_engine(bundle("llama"), threads=1), quick_store, batch=1, save_delay=0.05)
    quick.submit(base, 1).tokens()
    deadline = time.monotonic() + 30
    while store_keys_missing(quick_store, base) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store_keys_missing(quick_store, base)  # idle: the records were made
    quick.stop()


def store_keys_missing(store: PrefixStore, tokens: list[int]) -> bool:
    keys = store.block_keys(tokens)
    return not all(k in store for k in [*keys, store.tail_key(keys)])


def test_cache_prompt_false_neither_uses_nor_leaves_records(bundle: Callable[[str], Path]) -> None:
    store = PrefixStore("test", max_records=16)
    runner = _Runner(load_engine(bundle("mistral"), threads=1), store, batch=1)
    prompt = _rand(150, 11)
    want = runner.submit(prompt, 6, cache_prompt=False).tokens()
    assert store.stats().records == 0 and store.stats().lookups == 0
    runner.submit(prompt, 6).tokens()
    assert store.stats().tokens_reused == 0  # nothing was left behind by the opted-out request
    assert runner.submit(prompt, 6, cache_prompt=False).tokens() == want
    assert store.stats().tokens_reused == 0 and store.stats().lookups == 1
    assert runner.submit(prompt, 6).tokens() == want
    # The opted-out run overwrote the slot: records serve the whole prompt (blocks, and the tail
    # with the logits after it).
    assert store.stats().tokens_reused == 150
    runner.stop()


def test_cache_prompt_false_never_takes_a_slot_holding_a_cached_prefix(bundle: Callable[[str], Path]) -> None:
    # Slot 0 ends up holding prompt a, slot 1 prompt b. An opted-out request for b must take the
    # lowest free slot like any request without a prefix, not b's slot: landing there would
    # wipe the prefix b's next request resumes from (it would fall back to copying records).
    store = PrefixStore("test", max_records=16)
    runner = _Runner(load_engine(bundle("mistral"), threads=1), store, batch=2)
    a, b = _rand(150, 21), _rand(150, 22)
    first, second = runner.submit(a, 24), runner.submit(b, 4)
    first.tokens(), second.tokens()
    held = runner.sched._slot_tokens  # precondition: the layout this test is about
    assert held[0][:150] == a and held[1][:150] == b, "a and b did not run side by side"
    want = runner.submit(b, 4, cache_prompt=False).tokens()
    before = store.stats()
    assert runner.submit(b, 4).tokens() == want
    after = store.stats()
    # All of it: 149 tokens from b's own slot, then the tail record (whole prompt and the
    # logits after it) copied back; from records instead, its two blocks would come too.
    assert after.tokens_reused - before.tokens_reused == 150
    assert after.record_hits - before.record_hits == 1
    runner.stop()


def test_a_new_prompt_takes_a_saved_slot_and_leaves_the_pending_save_for_idle(
        bundle: Callable[[str], Path]) -> None:
    # A prompt that shares nothing with any slot goes to the lowest slot whose blocks are saved:
    # slot 0 still owes its blocks (the idle delay has not passed), so the next request runs in
    # slot 1 and slot 0's save waits for idle instead of running on the scheduler thread before
    # the new prefill (it cost 70 ms of TTFT and a third of the decode speed after a 1,500-token
    # SmolLM2 prompt on 2 cores).
    store = PrefixStore("test", max_records=32)
    runner = _Runner(load_engine(bundle("llama"), threads=1), store, batch=2, save_delay=60)
    a, c = _rand(150, 41), _rand(150, 42)
    fresh = list(reversed(c))
    want_c = runner.submit(c, 6).tokens()  # slot 0
    runner.sched._flush_saves()
    assert runner.submit(a, 6).tokens()  # slot 0 again (lowest, saved); its blocks now pending
    assert runner.sched.pending_record_saves == 1
    blocks_of_a = store.block_keys(a)
    assert runner.submit(fresh, 6).tokens()  # nothing shared with a or c
    held = runner.sched._slot_tokens
    assert held[0][:150] == a, "the slot with the pending save was taken"
    assert held[1][:150] == fresh
    assert runner.sched.pending_record_saves == 2
    assert not any(k in store for k in blocks_of_a), "slot 0's blocks were saved before idle"
    # Both slots owe blocks now: the next new prompt takes the lowest and saves it first.
    assert runner.submit(c, 6).tokens() == want_c
    assert all(k in store for k in blocks_of_a)
    runner.stop()


def test_a_new_prompt_takes_no_slot_that_would_ride_as_a_passenger(bundle: Callable[[str], Path]) -> None:
    # The slot choice itself, on set states (the scheduler not started): slots 0-2 running with
    # a gap at 1 would make slot 1 a passenger of every decode (over its whole held context)
    # unless the new request takes it; with no gap, a slot next to the running range beats a
    # lower one that would open a gap; among slots that owe a save, the cheaper save wins.
    store = PrefixStore("test", max_records=8)
    sched = Scheduler(load_engine(bundle("llama"), threads=1), max_batch_size=6, max_queued_requests=8,
                      queue_timeout=60, context_cache=store, save_delay=60)
    state = GenerationState(IdTokens(), prompt_ids=[1, 2, 3], max_new_tokens=1)  # type: ignore[arg-type]
    sampler = Sampler(SamplingParams(temperature=0.0), 384)
    req = GenerationRequest([1, 2, 3], sampler, state, CollectingSink())
    running = GenerationRequest([4, 5, 6], sampler, state, CollectingSink())

    def pick(busy: list[int], pending: dict[int, int]) -> int:
        sched._running = [_Running(running, s) for s in busy]
        sched._free_slots = [s for s in range(6) if s not in busy]
        sched._pending_saves = {s: (_Running(running, s), [7] * n) for s, n in pending.items()}
        return sched._pick_slot(req)

    assert pick([], {}) == 0
    assert pick([], {0: 1500}) == 1  # nothing running: a saved slot, no passenger either way
    assert pick([], {0: 1500, 1: 96}) == 2
    assert pick([0, 2], {1: 1500}) == 1  # the gap: its save now beats a passenger for good
    assert pick([3, 4], {}) == 2  # next to the range, not 0 or 1 (passengers 1-2 or 2)
    assert pick([3, 4], {2: 96}) == 5  # next to the range and nothing to save
    assert pick([3, 4], {2: 96, 5: 1500}) == 2  # both adjacent: the cheaper save
    assert pick([3, 4], {2: 1500, 5: 96}) == 5
    assert pick([1, 2, 3, 4], {0: 1500, 5: 1500}) == 0  # equal: the lowest


def test_cache_salt_separates_slots_and_records(bundle: Callable[[str], Path]) -> None:
    # Two slots so that a salted request could land on the slot an unsalted one left (and the
    # other way round): neither the slot's KV nor the records may serve across salts.
    store = PrefixStore("test", max_records=32)
    runner = _Runner(load_engine(bundle("llama"), threads=1), store, batch=2)
    prompt = _rand(150, 31)
    want = runner.submit(prompt, 6).tokens()
    assert store.stats().tokens_reused == 0

    def reused(**kw: Any) -> int:
        before = store.stats().tokens_reused
        assert runner.submit(prompt, 6, **kw).tokens() == want  # same tokens whatever is reused
        return store.stats().tokens_reused - before

    assert reused(cache_salt="tenant-a") == 0  # the unsalted slot and records stay unseen
    assert reused(cache_salt="tenant-b") == 0  # and so do tenant-a's
    # The same salt finds its own prefix, all 150 tokens: from its slot and its tail record (the
    # tail kept the logits after the prompt) or, when another salt's request took that slot
    # since, from its records (two blocks and the tail).
    assert reused(cache_salt="tenant-a") == 150
    assert reused() == 150  # the unsalted prefix is still there for unsalted requests
    assert reused(cache_salt="tenant-b") == 150
    assert reused(cache_salt="tenant-b") == 150  # now from the slot it just left
    runner.stop()


def test_salted_block_keys_differ_per_salt_and_from_unsalted() -> None:
    tokens = _rand(128, 13)
    store = PrefixStore("bundle:a", max_records=8)
    plain, a, b = store.block_keys(tokens), store.block_keys(tokens, "a"), store.block_keys(tokens, "b")
    assert len({*plain, *a, *b}) == 6  # no key of one chain appears in another
    assert store.block_keys(tokens, "a") == a  # deterministic: a restart finds the same keys
    store.insert(a[0], tokens[:64], np.zeros((4, 2, 64, 16), np.float32))
    assert store.fetch(plain, tokens, 0) == [] and store.fetch(b, tokens, 0) == []
    assert len(store.fetch(a, tokens, 0)) == 1


def test_records_are_namespaced_by_bundle() -> None:
    tokens = _rand(128, 12)
    a, b = PrefixStore("bundle:a", max_records=8), PrefixStore("bundle:b", max_records=8)
    keys_a = a.block_keys(tokens)
    kv = np.zeros((4, 2, 64, 16), np.float32)
    a.insert(keys_a[0], tokens[:64], kv)
    assert b.block_keys(tokens) != keys_a
    assert b.fetch(b.block_keys(tokens), tokens, 0) == []
    assert len(a.fetch(keys_a, tokens, 0)) == 1
    # A key collision with other tokens is refused by the stored tokens.
    other = [*tokens[:63], (tokens[63] + 1) % 384, *tokens[64:]]
    assert a.fetch(keys_a, other, 0) == []


def test_pool_bytes_bound_a_200_request_run(bundle: Callable[[str], Path]) -> None:
    limit = 6 * BLOCK_BYTES + 100
    store = PrefixStore("test", max_records=1000, max_bytes=limit)
    engine = load_engine(bundle("llama"), threads=1)
    runner = _Runner(engine, store, batch=4, chunk=64)
    rng = np.random.default_rng(13)
    shared = [_rand(int(n), 100 + i) for i, n in enumerate(rng.integers(64, 200, size=5))]
    prompts = [[*shared[int(rng.integers(5))], *_rand(int(rng.integers(1, 40)), 200 + i)] for i in range(200)]
    peak = 0
    outs: list[list[int]] = []
    for start in range(0, 200, 8):
        sinks = [runner.submit(p, 2) for p in prompts[start : start + 8]]
        outs.extend(s.tokens() for s in sinks)
        peak = max(peak, store.stats().bytes)
    runner.stop()
    stats = store.stats()
    assert peak <= limit and stats.bytes <= limit  # records: at most 6 blocks, tails are smaller
    assert stats.evictions > 0 and stats.hits > 50  # how many depends on which slot each request lands in
    cold = _Runner(load_engine(bundle("llama"), threads=1), None, batch=1)
    sample = list(range(0, 200, 23))
    assert cold.one_by_one([prompts[i] for i in sample], 2) == [outs[i] for i in sample]
    cold.stop()


def test_store_evicts_least_recently_used_by_records_and_by_bytes() -> None:
    kv = np.zeros((4, 2, 64, 16), np.float32)
    tokens = _rand(64 * 6, 14)
    store = PrefixStore("test", max_records=3)
    keys = store.block_keys(tokens)
    assert len(keys) == 6 and len(set(keys)) == 6
    for i in range(3):
        assert store.insert(keys[i], tokens[i * 64 : (i + 1) * 64], kv)
    assert store.touch(keys[0])
    store.insert(keys[3], tokens[192:256], kv)
    assert [k in store for k in keys[:4]] == [True, False, True, True]
    small = PrefixStore("test", max_records=100, max_bytes=int(2.5 * kv.nbytes))
    for i in range(4):
        small.insert(keys[i], tokens[i * 64 : (i + 1) * 64], kv)
    assert small.stats().records == 2 and small.stats().bytes == 2 * kv.nbytes
    assert small.stats().evictions == 2
    assert not PrefixStore("test", max_records=0).insert(keys[0], tokens[:64], kv)
    assert not PrefixStore("test", max_records=9, max_bytes=kv.nbytes - 1).insert(keys[0], tokens[:64], kv)


def test_fp16_kv_reuses_prefixes_with_the_same_tokens_in_about_half_the_bytes(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    """A ``--kv-cache-dtype fp16`` bundle stores and restores float16 blocks: reuse changes no
    token, and the same conversation's records take about half the bytes of fp32 KV's (the logits
    kept with a record stay float32)."""
    prompts = _conversation()
    used: list[int] = []
    answers: list[list[list[int]]] = []
    for dtype in ("fp32", "fp16"):
        bundle_dir = built_bundle(hf_checkpoint("llama"), max_batch_size=2, max_kv_cache_capacity=512,
                                  kv_cache_dtype=dtype)
        cold = _Runner(load_engine(bundle_dir, threads=1), None, batch=1)
        want = cold.one_by_one(prompts, 10)
        cold.stop()
        store = PrefixStore("test", max_records=64)
        warm = _Runner(load_engine(bundle_dir, threads=1), store, batch=2)
        assert warm.one_by_one(prompts, 10) == want
        warm.settle()
        warm.stop()
        stats = store.stats()
        assert stats.hits >= 6 and stats.tokens_reused > 800
        used.append(stats.bytes)
        answers.append(want)
    assert answers[1] == answers[0]
    assert 0.4 < used[1] / used[0] < 0.75, used
