"""``python -m bgeserve`` is the ``bgeserve`` command."""

import sys

from bgeserve.cli import main

sys.exit(main())
