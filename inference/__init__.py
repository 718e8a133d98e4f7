"""The engine side of cachesvc: checkpoint -> bundle builders, bundle -> token runtimes, serving.

This package never imports ``cachesvc``.
"""

from __future__ import annotations
