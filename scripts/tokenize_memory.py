#!/usr/bin/env python3
"""Peak memory and time of tokenizing one maximal request: ``--texts`` texts of ``--chars``
characters (250 x 131,000: just under the default 32 MiB body and 131,072-character text
limits), with an export's tokenizer and ``max_seq`` tokens kept per text. ``--repo`` measures
another checkout (one process per run: peak RSS is per process)::

    python scripts/tokenize_memory.py --tokenizer EXPORT/tokenizer.json
    python scripts/tokenize_memory.py --tokenizer EXPORT/tokenizer.json --repo OLD_CHECKOUT
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--texts", type=int, default=250)
    p.add_argument("--chars", type=int, default=131_000)
    p.add_argument("--max-seq", type=int, default=8192)
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.repo))
    import psutil

    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.export.texts import random_texts

    base = " ".join(random_texts(1, 3000, 8, 16))[:args.chars]
    texts = [base[i:] + base[:i] for i in range(0, args.texts * 7, 7)]  # distinct rotations
    tokenizer = Tokenizer.load(args.tokenizer, args.max_seq)
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    encoded = tokenizer.encode(texts)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{args.repo}: {len(texts)} texts x {len(base)} characters in {seconds:.1f} s; peak "
          f"RSS {peak >> 20} MiB ({(peak - before) >> 20} MiB over the {before >> 20} MiB "
          f"before); {sum(len(x) for x in encoded.ids)} tokens kept, "
          f"{int(encoded.truncated.sum())} texts truncated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
