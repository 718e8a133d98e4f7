"""From the parsed arguments to what a command works on: the cache's config and the cache."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cachesvc.settings.config import ServeConfig
from cachesvc.settings.groups import CACHE_OPTIONS

if TYPE_CHECKING:
    from cachesvc.cache.manager import CacheManager


class CliError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def cache_config(args: argparse.Namespace) -> ServeConfig:
    """The cache options given on the command line, validated and defaulted like ``serve``'s."""
    given = {name: getattr(args, name, None) for name in CACHE_OPTIONS}
    return ServeConfig.from_mapping({k: v for k, v in given.items() if v is not None})


def open_manager(args: argparse.Namespace) -> CacheManager:
    """The cache the cache options name, opened as a command opens it (``open_cache``)."""
    from cachesvc.serving.entry import open_cache

    return open_cache(cache_config(args))
