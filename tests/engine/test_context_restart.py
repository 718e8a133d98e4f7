"""Context records on disk through the scheduler on a real engine: a new engine, store and
scheduler on the same record directory (a restart) resumes from the records and yields the same
greedy tokens as a cold run; stopping the scheduler writes what is still queued."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from inference.runtime import load_engine
from inference.serving.context_cache import PrefixStore
from inference.serving.context_disk import DiskRecords
from inference.serving.generation import GenerationState
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.scheduler import GenerationRequest, Scheduler
from tests.support.scheduling import CollectingSink, IdTokens


def _run(bundle: Path, store: PrefixStore | None, prompt: list[int], steps: int,
         salt: str | None = None) -> list[int]:
    engine = load_engine(bundle, threads=1)
    sched = Scheduler(engine, max_batch_size=1, max_queued_requests=4, queue_timeout=120,
                      prefill_chunk=64, context_cache=store)
    sched.start()
    try:
        sink = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=prompt, max_new_tokens=steps)  # type: ignore[arg-type]
        sampler = Sampler(SamplingParams(temperature=0.0), engine.info.vocab_size)
        sched.submit(GenerationRequest(prompt, sampler, state, sink, cache_salt=salt))
        return sink.tokens()
    finally:
        sched.stop()
        engine.close()


def test_a_restart_resumes_from_the_records_on_disk(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path], tmp_path: Path
) -> None:
    bundle = built_bundle(hf_checkpoint("llama", "fp32", False), max_batch_size=2, max_kv_cache_capacity=512)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 384, size=200)]
    want = _run(bundle, None, prompt, 8)
    records = tmp_path / "context" / "b1"

    def store() -> PrefixStore:
        return PrefixStore("bundle:b1", max_records=64, disk=DiskRecords(records, max_bytes=1 << 24))

    first = store()
    assert _run(bundle, first, prompt, 8) == want
    # 200 prompt + 7 fed back tokens: 3 complete blocks and the tail (8 prompt tokens at the
    # first token, then 15 at the end, in place), written before stop() returned.
    assert first.stats().disk_writes == 5 and len(list(records.glob("*.kv"))) == 4

    again = store()
    assert _run(bundle, again, prompt, 8) == want
    stats = again.stats()
    # The whole prompt: 3 blocks and the tail, which kept the logits after the prompt.
    assert stats.disk_hits == 4 and stats.tokens_reused == 200 and stats.hits == 1

    # A damaged record: dropped, the prefix up to it reused, the answer still the cold one.
    path = records / (first.block_keys(prompt)[1].hex() + ".kv")  # the middle block
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    third = store()
    assert _run(bundle, third, prompt, 8) == want
    stats = third.stats()
    assert stats.disk_dropped == 1 and stats.disk_hits == 1 and stats.tokens_reused == 64
    # That block was prefilled again and its record written anew, whole this time; so was the
    # tail (twice, as in the first run: the broken chain never read it back).
    assert stats.disk_writes == 3 and path.read_bytes() != bytes(data)
    assert len(store().fetch(third.block_keys(prompt), prompt, 0)) == 3
