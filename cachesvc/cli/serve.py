"""``cachesvc serve`` and ``cachesvc prepare``: run a model, or build (or find) its bundle."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cachesvc.cache.gguf_checkpoints import hub_gguf_spec
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json
from cachesvc.errors import CheckpointError
from cachesvc.serving.build_progress import BuildProgress
from cachesvc.settings.config import ServeConfig, add_build_arguments, add_serve_arguments
from cachesvc.settings.groups import DECLARED, engine_factory_spec


def cmd_prepare(args: argparse.Namespace) -> int:
    from cachesvc.serving.default_model import choose

    config = _serve_config(args)
    m = open_manager(args)
    try:
        with BuildProgress() as progress:
            result = m.prepare(
                config.build.model or choose(config.cache.cache_dir)[0],
                config.profile_request(),
                progress=progress,
            )
    finally:
        m.close()
    if args.json:
        emit_json(
            {
                "bundle_id": result.bundle_id,
                "bundle_dir": str(result.bundle_dir),
                "model_dir": str(result.model_dir),
                "draft_dir": str(result.draft_dir) if result.draft_dir else None,
                "draft_bundle_id": result.draft_bundle_id,
                "draft_bundle_dir": str(result.draft_bundle_dir) if result.draft_bundle_dir else None,
                "built": result.built,
                "build_seconds": result.build_seconds,
                "pulled_from": result.pulled_from,
            }
        )
    else:
        verb = f"built in {result.build_seconds:.1f}s" if result.built else "cache hit"
        if result.pulled_from is not None:
            verb = f"pulled from {result.pulled_from}"
        print(f"{result.bundle_id}  {verb}\n{result.bundle_dir}")
    return 0


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig.from_namespace(args)
    gguf_file = getattr(args, "gguf_file", None)
    if gguf_file is not None:
        if config.build.model is None:
            raise CheckpointError("--gguf-file names a file in a hub repo; give the repo id as the model")
        build = dataclasses.replace(config.build, model=hub_gguf_spec(config.build.model, gguf_file))
        config = dataclasses.replace(config, build=build)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    from cachesvc.serving.default_model import choose
    from cachesvc.serving.model_loading import engine_factory_from_spec
    from cachesvc.serving.server import serve

    # Without a model the whole catalog is served, with the default model when this is a first
    # run or the catalog holds it (cachesvc.serving.default_model). The environment's factory
    # (CACHESVC_ENGINE_FACTORY, read by the config) is the test-only way into the engine seam.
    return serve(
        config,
        engine_factory=engine_factory_from_spec(engine_factory_spec()),
        default_model=lambda: choose(config.cache.cache_dir),
    )


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``serve`` and ``prepare``, with their own cache and build flags."""
    p = sub.add_parser(
        "serve", help="prepare a bundle and serve OpenAI-style completions", allow_abbrev=False
    )
    add_serve_arguments(p)
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="serve this .gguf file of the hub repo given as the model")
    p.set_defaults(func=cmd_serve, engine_cache_max_size_gb=None)

    p = sub.add_parser(
        "prepare", help="build (or find) the bundle for a model and profile", allow_abbrev=False
    )
    # Checked with the rest of the config (from_namespace): its error is the config's.
    p.add_argument("model", nargs="?", default=None, help=DECLARED["model"].spec.help)
    add_build_arguments(p)
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="serve this .gguf file of the hub repo given as the model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_prepare, engine_cache_max_size_gb=None)
