"""The quality gate's choice rule, checked on what a build recorded (``engine.json``)."""

from __future__ import annotations

from typing import Any

from inference.builder.kernel_plan import PLAN_GROUPS, TWO_TERM_PLANS


def check_gate_choice(meta: dict[str, Any]) -> dict[str, Any]:
    """Assert that ``meta``'s quality record follows the gate's rule; return the chosen candidate.

    The candidates are tried fastest first in :data:`PLAN_GROUPS` order and the first that passes
    is published: every one before it failed, a plan faster than exact passed under ``auto`` only
    with every prompt's free-running tokens equal to fp32's (or to the exact plan's), a two-term
    plan only when it also decoded faster than the exact plan (else it says so), and
    ``kernels`` in ``engine.json`` is the chosen plan. An int8 plan with level-4 layers is then
    written again with 8-bit codes and measured once more: kept when it passes too; an int8
    two-term plan that was slower than exact on two planes gets that try before the next plan.
    """
    quality, kernels = meta["quality"], meta["kernels"]
    candidates = quality["candidates"]
    first = next(i for i, c in enumerate(candidates) if c["passed"])
    rejected, passed = candidates[:first], candidates[first]
    order = list(PLAN_GROUPS)
    # An int8 two-term plan slower than exact on two planes is tried again as 8-bit codes.
    names = [c["plan"] for i, c in enumerate(candidates[: first + 1])
             if not (i and c["plan"] == candidates[i - 1]["plan"] and c["int8_layout"] == "codes")]
    assert names == order[order.index(names[0]):][: len(names)], names
    for i, c in enumerate(candidates[1: first + 1], start=1):
        if c["plan"] == candidates[i - 1]["plan"]:  # the codes retry follows a slower planes try
            assert candidates[i - 1]["slower_than_exact"] and c["plan"] in TWO_TERM_PLANS, candidates
    assert not any(c["passed"] for c in rejected), candidates
    chosen = passed
    if passed["int8_layout"] == "codes":  # chosen in the codes retry above
        assert meta["precision"] == "int8" and passed["plan"] in TWO_TERM_PLANS
        assert len(candidates) == first + 1
    elif len(candidates) > first + 1:  # the chosen int8 plan written again as 8-bit codes
        (again,) = candidates[first + 1:]
        assert again["plan"] == passed["plan"]
        assert (again["int8_layout"], passed["int8_layout"]) == ("codes", "planes")
        assert passed["int8_groups"] and meta["precision"] == "int8"
        chosen = again if again["passed"] else passed
    elif meta["precision"] == "int8" and passed["int8_groups"] and passed["int8_layout"] != "codes":
        raise AssertionError(f"an int8 plan at level 4 was not written again as codes: {candidates}")
    assert kernels["int8_layout"] == chosen["int8_layout"]
    assert quality["plan"] == kernels["name"] == chosen["plan"]
    assert kernels["int8_groups"] == chosen["int8_groups"] == list(PLAN_GROUPS[chosen["plan"]])
    assert kernels["two_term"] == (chosen["plan"] in TWO_TERM_PLANS)
    assert chosen["greedy_agreement"] >= quality["threshold"]
    for c in rejected:
        assert c["greedy_agreement"] < quality["threshold"] or c["slower_than_exact"] or (
            quality["kernels_mode"] == "auto" and c["identical"] < quality["prompts"]), c
    for c in candidates:  # only a two-term plan is weighed against the exact plan's speed
        assert not c["slower_than_exact"] or (c["plan"] in TWO_TERM_PLANS and not c["passed"]), c
    for c in candidates:
        assert c["decode_tok_s"] > 0 and c["decode_tok_s_rows"] > 0 and c["seconds"] > 0
    return dict(chosen)
