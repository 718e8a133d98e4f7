"""The quality gate's choice rule, checked on what a build recorded (``engine.json``)."""

from __future__ import annotations

from typing import Any

from inference.builder.kernel_plan import PLAN_GROUPS


def check_gate_choice(meta: dict[str, Any]) -> dict[str, Any]:
    """Assert that ``meta``'s quality record follows the gate's rule; return the chosen candidate.

    The candidates are tried fastest first in :data:`PLAN_GROUPS` order and the first that passes
    is published: every one before it failed, a plan faster than exact passed under ``auto`` only
    with every prompt's free-running tokens equal to fp32's (or to the exact plan's), and
    ``kernels`` in ``engine.json`` is the chosen plan.
    """
    quality, kernels = meta["quality"], meta["kernels"]
    candidates = quality["candidates"]
    order = list(PLAN_GROUPS)
    names = [c["plan"] for c in candidates]
    assert names == order[order.index(names[0]):][: len(names)], names
    *rejected, chosen = candidates
    assert chosen["passed"] and not any(c["passed"] for c in rejected), candidates
    assert quality["plan"] == kernels["name"] == chosen["plan"]
    assert kernels["int8_groups"] == chosen["int8_groups"] == list(PLAN_GROUPS[chosen["plan"]])
    assert chosen["greedy_agreement"] >= quality["threshold"]
    for c in rejected:
        assert c["greedy_agreement"] < quality["threshold"] or (
            quality["kernels_mode"] == "auto" and c["identical"] < quality["prompts"]), c
    for c in candidates:
        assert c["decode_tok_s"] > 0 and c["decode_tok_s_rows"] > 0 and c["seconds"] > 0
    return dict(chosen)
