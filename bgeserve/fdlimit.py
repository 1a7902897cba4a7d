"""The open-file limit a server needs: every connection is a file descriptor.

A systemd unit without ``LimitNOFILE``, or a shell's ``ulimit -n 1024``, lets ~1,000 idle
keep-alive connections (each held up to ``BGE_M3_KEEP_ALIVE_SECS``) exhaust it; uvloop then
accepts and drops every new connection, health probes included, without a log line, and a
session reloaded after an idle unload failed with "system error number 24" (QA). Go and the
JVM raise their soft limit to the hard one at start; ``serve`` does the same.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("bgeserve")
CEILING = 1 << 20  # where the hard limit is unlimited: Linux's default fs.nr_open
LOW = 4096  # below this after raising, say so: a busy server may run out


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most ``CEILING``); the soft limit
    in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("open-file limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as exc:  # a container's seccomp, fs.nr_open below it
            log.debug("open-file limit %d could not be raised to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < LOW:
        log.warning("the open-file limit is %d (hard limit %s): the server holds ~%d "
                    "connections at once, then drops new ones without an answer; raise it "
                    "(ulimit -n, systemd LimitNOFILE, docker --ulimit nofile)", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, max(0, soft - 64))
    return soft
