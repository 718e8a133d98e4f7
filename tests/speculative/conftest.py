"""Fixtures of the speculative-decoding tests, borrowed from the areas they build on: the
tiny demo checkpoint of the service tests, and SmolLM2 from its GGUF (built once a session)."""

from __future__ import annotations

from tests.gguf.conftest import bundle_of, smollm2_bundle, smollm2_dir, smollm2_gguf  # noqa: F401 - fixtures
from tests.service.conftest import demo_dir  # noqa: F401 - fixture
