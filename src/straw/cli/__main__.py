"""``python -m straw.cli``: the ``straw`` command."""

from __future__ import annotations

import sys

from straw.cli import main

sys.exit(main())
