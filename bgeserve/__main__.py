"""``python -m bgeserve`` is the ``bgeserve`` command."""

import sys

from .cli import main

sys.exit(main())
