#!/usr/bin/env python3
"""Build a hub-layout snapshot (BAAI/bge-m3, Xenova/bge-m3 or an optimum export) from a local
PyTorch bge-m3, e.g. the full-size random model, to try `bgeserve serve` / `bgeserve prepare` on
the hub's own graph shapes without downloading anything (needs the export extra: torch).

    python scripts/hub_snapshot.py /work/fullsize/bge-full /tmp/bge-full-baai --layout baai
    BGE_M3_MODEL_PATH=/tmp/bge-full-baai bgeserve serve

See bgeserve/testing/hubsnap.py for what each layout holds.
"""

import sys

from bgeserve.testing.hubsnap import main

if __name__ == "__main__":
    sys.exit(main())
