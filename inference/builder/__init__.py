"""Checkpoint directory -> engine bundle directory."""

from __future__ import annotations
