"""``/admin/stats`` (cache statistics of one node) and ``/admin/events`` (the audit log)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from litestar import get
from litestar.params import QueryParameter

from cachesvc.http.admin.params import BUNDLE_ID_PATTERN, Limit, Manager, NodeFilter
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import EventKind, EventListOut, StatsOut, to_body


def _utc(moment: datetime | None) -> datetime | None:
    # A naive timestamp in a query is read as UTC, the catalog's only timezone.
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


@get(
    "/stats",
    sync_to_thread=True,
    operation_id="getStats",
    tags=["stats"],
    responses=problem_responses(400, 404),
)
def get_stats(manager: Manager, node: NodeFilter = None) -> StatsOut:
    """Cache statistics from the catalog's events of one node (default: the answering node)."""
    return to_body(manager.queries.stats(node), StatsOut)


@get(
    "/events",
    sync_to_thread=True,
    operation_id="listEvents",
    tags=["stats"],
    responses=problem_responses(400),
)
def list_events(
    manager: Manager,
    kind: Annotated[EventKind | None, QueryParameter(description="Only events of this kind")] = None,
    since: Annotated[
        datetime | None, QueryParameter(description="Only events at or after (UTC if naive)")
    ] = None,
    bundle_id: Annotated[
        str | None, QueryParameter(pattern=BUNDLE_ID_PATTERN, description="Only events of this bundle")
    ] = None,
    limit: Limit = 100,
    node: NodeFilter = None,
) -> EventListOut:
    """The audit log, newest first (every node's unless ``node`` is given)."""
    events = manager.catalog.events.recent(
        kind=kind, since=_utc(since), limit=limit, bundle_id=bundle_id, node=node
    )
    return to_body({"items": events}, EventListOut)
