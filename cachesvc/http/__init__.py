"""HTTP layer of the cache service: admin REST API, problem-JSON errors, auth guard, metrics."""

from __future__ import annotations
