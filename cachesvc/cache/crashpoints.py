"""Named crash points: where the crash tests kill a process, deterministically.

``CACHESVC_CRASH_AT=<name>`` makes the process SIGKILL itself when it reaches the point of that
name, so a test can stop a build or a publish exactly between two steps whose order matters
(instead of sleeping and hoping). Unset, a point costs one environment lookup. Points:

- ``publish:staged``: the manifest is written and everything is fsynced in staging; nothing
  outside staging has changed yet.
- ``publish:moved-aside``: an existing (condemned) bundle directory was moved into the trash;
  the new one is not renamed in yet.
- ``publish:renamed``: the staging directory was renamed onto the final path; its parent is not
  fsynced yet.
- ``build:published``: the bundle is published; the catalog row is not marked ready yet.
- ``pull:layer``: the first layer of a bundle pulled from a registry is in its staging
  directory; nothing is published yet.
- ``gguf:converted``: a GGUF file is converted into its staging directory (under
  ``checkpoints/gguf/``), which is not published yet.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "CACHESVC_CRASH_AT"
POINTS = ("publish:staged", "publish:moved-aside", "publish:renamed", "build:published", "pull:layer",
          "gguf:converted")


def crash_point(name: str) -> None:
    """SIGKILL this process if ``CACHESVC_CRASH_AT`` names ``name`` (test hook; no-op otherwise)."""
    if os.environ.get(ENV_VAR) == name:
        os.kill(os.getpid(), signal.SIGKILL)
