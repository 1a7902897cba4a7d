"""Ids that come more than once in a job's output: counted and named, never dropped.

Every row is embedded and written whatever its id (the id is the caller's, and two rows may
share one on purpose), so a reader of the output sees a repeated id as many times as it came.
What the job owes the caller is to say so: the summary counts them and a warning names a few.
The ids of earlier runs' shards are read first (one column of each shard), so a rerun that
embeds rows again — an input moved to another path is a new source — is counted too. The set
of ids is held in memory, some 100 bytes per id: past ``MAX_TRACKED`` ids (~200 MiB) no more
are added (a log line says so), so the memory a job needs stays bounded whatever its size,
and ids beyond are checked against those only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from bgeserve.bulk.shards import ShardInfo

log = logging.getLogger("bgeserve.bulk")
EXAMPLES = 5  # ids the warning names
MAX_TRACKED = 2_000_000  # ids remembered at most (memory: the engine's budget ignores this)


class Duplicates:
    """The ids written so far, and those that came again."""

    def __init__(self, earlier: Iterable[str] = (), max_tracked: int = MAX_TRACKED):
        self._seen: set[str] = set()
        self._max = max_tracked
        self.count = 0  # rows whose id was written before (by this run or an earlier one)
        self.examples: list[str] = []
        self._record(earlier, repeats=False)

    @classmethod
    def of_shards(cls, shards: Sequence[ShardInfo], max_tracked: int = MAX_TRACKED
                  ) -> Duplicates:
        """The ids the finished ``shards`` hold (their ``id`` column alone is read, shard by
        shard, no further than ``max_tracked`` ids: a resumed job of millions of rows read them
        all into one list before)."""
        ids = cls(max_tracked=max_tracked)
        for shard in shards:  # one at a time, and no further than what is remembered
            if ids.full:
                break
            if shard.rows:
                ids._record(shard_ids(shard.path), repeats=False)
        return ids

    @property
    def full(self) -> bool:
        """Whether no more ids are remembered (``max_tracked``)."""
        return len(self._seen) >= self._max

    def add(self, ids: Iterable[str]) -> None:
        """Record ``ids`` as written; count those written before."""
        self._record(ids, repeats=True)

    def add_shards(self, paths: Iterable[Path]) -> None:
        """``add`` the ids of the shards at ``paths``, read one shard at a time (a Ray job's
        write tasks return no ids: all of a big job's at once would not fit the driver)."""
        for path in paths:
            self.add(shard_ids(path))

    def _record(self, ids: Iterable[str], repeats: bool) -> None:
        """Remember ``ids``; count the repeats among them when ``repeats`` (earlier shards'
        own repeats were told by the run that wrote them)."""
        for row_id in ids:
            if row_id in self._seen:
                if repeats:
                    self.count += 1
                    if len(self.examples) < EXAMPLES and row_id not in self.examples:
                        self.examples.append(row_id)
            elif len(self._seen) < self._max:
                self._seen.add(row_id)
                if len(self._seen) == self._max:
                    log.info("duplicate ids: %d ids remembered, the most kept in memory; "
                             "later ids are checked against those only", self._max)

    def warn(self) -> None:
        """One warning naming a few of the repeated ids, if any."""
        if self.count:
            log.warning("%d rows have an id written before, in this run or an earlier one "
                        "(%s): each is embedded and written, so readers see those ids more "
                        "than once", self.count, ", ".join(map(repr, self.examples)),
                        extra={"duplicate_ids": self.count, "examples": self.examples})


def shard_ids(path: Path) -> list[str]:
    """The ``id`` column of the shard at ``path`` (the only column read)."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["id"])["id"].to_pylist()
