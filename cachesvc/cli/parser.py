"""The ``cachesvc`` argument parser: the cache options, then each command group's parsers (in the
group's module, next to its commands)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from cachesvc import __version__
from cachesvc.cli import adapters, bundles, checkpoints, db, demo, fleet, models, registry, serve, whole_cache
from cachesvc.settings.config import add_cache_flags


def _cache_options(prefix: str = "") -> _OneLineParser:
    """The cache options; the top level stores them under ``top_*`` so that a subcommand's own
    defaults (argparse lets a subparser's defaults overwrite the parent's values) cannot hide them."""
    p = _OneLineParser(add_help=False)
    add_cache_flags(p.add_argument_group("cache"), prefix)
    return p


class _OneLineParser(argparse.ArgumentParser):
    """Bad input is one line on stderr (no usage dump), exit 2; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``cachesvc`` argument parser."""
    cache_opts = _cache_options()
    parser = _OneLineParser(
        prog="cachesvc",
        description="Engine-bundle cache for Hugging Face LLM checkpoints, with OpenAI-style serving.",
        parents=[_cache_options("top_")],
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"cachesvc {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    serve.add_commands(sub, cache_opts)
    bsub = bundles.add_commands(sub, cache_opts)
    whole_cache.add_commands(bsub, cache_opts)
    whole_cache.add_commands(sub, cache_opts)
    for group in (registry, checkpoints, adapters, models, db, fleet, demo):
        group.add_commands(sub, cache_opts)
    return parser
