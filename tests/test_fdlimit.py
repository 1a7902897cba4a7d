"""``serve`` raises its open-file limit: every connection is a file descriptor (QA: at a soft
limit of 1,024, ~1,000 idle keep-alive connections made the server drop every new one without a
word)."""

from __future__ import annotations

import resource
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


def hard_limit(at_most: int) -> int:
    """A hard limit the test may set: at most this machine's (only root may raise it)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return at_most if hard == resource.RLIM_INFINITY else min(hard, at_most)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = hard_limit(8192)
    out = run(64, hard)
    assert f"now {hard} {hard}" in out, out
    assert f"raised from 64 to {hard}" in out, out
    assert ("WARNING" in out) == (hard < 4096), out


def test_a_low_hard_limit_is_said_at_start() -> None:
    hard = hard_limit(1024)
    out = run(hard // 2, hard)
    assert f"now {hard} {hard}" in out, out
    assert f"WARNING the open-file limit is {hard} (hard limit {hard})" in out, out
