"""``serve`` raises its open-file limit: every connection is a file descriptor (QA: at a soft
limit of 1,024, ~1,000 idle keep-alive connections made the server drop every new one without a
word)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, resource, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(message)s")
from bgeserve.fdlimit import raise_open_files_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
print("now", raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run(soft: int, hard: int) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(soft), str(hard)],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    out = run(256, 8192)
    assert "now 8192 8192" in out, out
    assert "raised from 256 to 8192" in out and "WARNING" not in out, out


def test_a_low_hard_limit_is_said_at_start() -> None:
    out = run(512, 1024)
    assert "now 1024 1024" in out, out
    assert "WARNING the open-file limit is 1024 (hard limit 1024)" in out, out
