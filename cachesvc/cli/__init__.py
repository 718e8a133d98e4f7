"""The ``cachesvc`` command line: serve, prepare, bundles, registry, checkpoints, adapters, models,
db, fleet, demo-checkpoint.

Cache options (``--cache-dir``, ``--catalog-url``, ``--engine-cache-max-size-gb``) go before
the command and apply to every command; ``prepare`` and ``serve`` also accept them after.
Bad input exits 2 with one line on stderr; an operation that fails exits 1.

``console`` (the console script, :func:`main`) -> ``parser`` (:func:`~cachesvc.cli.parser.build_parser`)
-> one module per command group, each with its commands and their parsers (``serve``: serve and
prepare; ``bundles``; ``whole_cache``: prune, clear, reconcile, stats; ``registry``;
``checkpoints``; ``adapters``; ``models``; ``db``; ``fleet``; ``demo``) -> ``args`` (the parsed
arguments -> the cache's config, the cache) and ``output`` (tables, sizes, times, ``--json``).
"""

from __future__ import annotations

from cachesvc.cli.console import main

__all__ = ["main"]
