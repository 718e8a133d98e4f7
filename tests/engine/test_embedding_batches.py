"""The embedding engine's run plan (at most ``max_input_len`` padded tokens and ``MAX_ROWS`` rows
per run) and the working memory it bounds, which an embedding bundle's memory estimate counts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from inference.runtime.embedding_batches import MAX_ROWS, run_plan, working_bytes
from inference.runtime.registry import memory_estimate

#: SmolLM2-135M's shape, as its embedding bundle's engine.json records it.
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576, "num_heads": 9}


def _padded(lengths: list[int], run: list[int]) -> tuple[int, int]:
    """(padded tokens, attention pairs) of one run."""
    width = max(lengths[i] for i in run)
    return len(run) * width, len(run) * width * width


def test_every_run_fits_the_token_budget_and_every_input_runs_once() -> None:
    rng = random.Random(7)
    budget = 4096
    for _ in range(200):
        lengths = [rng.choice([1, 5, 30, 200, 1000, 3920, 4096]) for _ in range(rng.randint(1, 300))]
        plan = run_plan(lengths, max_tokens=budget)
        assert sorted(i for run in plan for i in run) == list(range(len(lengths)))
        for run in plan:
            tokens, pairs = _padded(lengths, run)
            assert len(run) <= MAX_ROWS and tokens <= budget
            assert pairs <= budget * budget  # never more attention than one longest input


def test_the_worst_request_the_limits_allow_costs_one_longest_input() -> None:
    # 2,048 inputs (300,000 tokens in all would be refused first; the plan holds either way).
    plan = run_plan([3920] * 2048, max_tokens=4096)
    assert len(plan) == 2048 and all(len(run) == 1 for run in plan)


def test_short_inputs_still_run_together() -> None:
    plan = run_plan([12] * 100, max_tokens=4096)
    assert [len(run) for run in plan] == [32, 32, 32, 4]
    # Sorted: the long input does not widen the short ones' run.
    plan = run_plan([10, 4000, 10, 10], max_tokens=4096)
    assert plan == [[0, 2, 3], [1]]


def test_an_input_longer_than_a_run_is_refused() -> None:
    with pytest.raises(ValueError, match="input 1 has 65 tokens"):
        run_plan([3, 65], max_tokens=64)


def test_working_memory_grows_with_the_square_of_max_input_len() -> None:
    small = working_bytes({**SMOLLM2, "max_input_len": 1024})
    large = working_bytes({**SMOLLM2, "max_input_len": 4096})
    # Above what was measured for one input of that length (128 and 1,013 MiB).
    assert 128 << 20 < small < large and large > 1013 << 20
    assert large > 6 * small  # linear growth would give 4x


def test_an_embedding_bundles_estimate_counts_its_working_memory(tmp_path: Path) -> None:
    meta = {**SMOLLM2, "task": "embed", "max_input_len": 2048, "weight_bytes": 5_000_000,
            "kv_bytes_per_token": 0, "max_kv_cache_capacity": 2048}
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    assert memory_estimate(tmp_path, max_slots=8) == 5_000_000 + working_bytes(meta)
