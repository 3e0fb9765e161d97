"""``python -m straw``: the ``straw`` command (see ``straw.cli``)."""

from __future__ import annotations

import sys

from straw.cli import main

sys.exit(main())
