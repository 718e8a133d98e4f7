"""The fleet side of a node: heartbeat and desired-state convergence (see ``agent``)."""

from __future__ import annotations

from cachesvc.fleet.agent import NodeAgent
from cachesvc.fleet.converge import Converger

__all__ = ["Converger", "NodeAgent"]
