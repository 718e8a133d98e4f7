"""The ``cachesvc`` console script: parse, log, run the command, exit with its status.

Bad input exits 2 with one line on stderr; an operation that fails exits 1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from cachesvc.cli.parser import build_parser
from cachesvc.errors import CacheError, CheckpointError, ConfigError, NotFoundError
from cachesvc.settings.config import cli_message
from cachesvc.settings.groups import CACHE_OPTIONS

_BAD_INPUT = (ConfigError, NotFoundError, CheckpointError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cachesvc`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in CACHE_OPTIONS:
        # A value given after the command wins over one given before it.
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(args, "top_" + name, None))
    if args.engine_cache_max_size_gb is None:
        del args.engine_cache_max_size_gb  # ServeConfig's default applies
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except _BAD_INPUT as exc:
        text = cli_message(exc) if isinstance(exc, ConfigError) else str(exc)
        print(f"cachesvc: error: {text}", file=sys.stderr)
        return 2
    except CacheError as exc:
        print(f"cachesvc: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`cachesvc stats --json | head`): that is not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by SIGPIPE
