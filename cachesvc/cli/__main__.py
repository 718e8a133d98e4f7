"""``python -m cachesvc.cli``: the ``cachesvc`` console script."""

from __future__ import annotations

import sys

from cachesvc.cli.console import main

sys.exit(main())
