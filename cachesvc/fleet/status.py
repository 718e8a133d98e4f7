"""``cachesvc fleet status``: one line per node, converged / converging / failed."""

from __future__ import annotations

from collections.abc import Sequence

from cachesvc.cache.fleet_records import DONE_ITEM_STATES, NodeInfo


def status_lines(nodes: Sequence[NodeInfo]) -> list[str]:
    """A table: node, up/down, convergence, items done/total, size/cap, bundles, bundles pulled
    from the registry / built, heartbeat, failures."""
    rows = [("NODE", "STATE", "DESIRED", "ITEMS", "SIZE/CAP", "BUNDLES", "PULLED/BUILT", "HEARTBEAT",
             "FAILED ITEMS")]
    for n in nodes:
        done = sum(i.state in DONE_ITEM_STATES for i in n.items)
        failed = "; ".join(f"{i.item}: {i.error}" for i in n.items if i.state == "failed")
        age = "never" if n.heartbeat_age_seconds is None else f"{n.heartbeat_age_seconds:.0f}s ago"
        rows.append(
            (
                n.name,
                n.state,
                n.convergence,
                f"{done}/{len(n.items)}",
                f"{n.size_bytes}/{n.max_size_bytes}",
                str(n.bundles),
                f"{n.pulled}/{n.built}",
                age,
                failed or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip() for r in rows
    ]


def exit_code(nodes: Sequence[NodeInfo]) -> int:
    """0 when every node that has desired state converged, 1 when any failed, 3 while converging."""
    states = {n.convergence for n in nodes}
    if "failed" in states:
        return 1
    if "converging" in states:
        return 3
    return 0
