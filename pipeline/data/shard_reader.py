"""Raw samples out of shard URLs, with a budget for corrupt data.

Object store URLs (s3://, gs://, hdfs://, any scheme pyarrow or fsspec has) open through
`data_prep.storage`, credentials from the environment; webdataset opens the rest (local path, file:,
pipe:, http, ...); `data_prep.tario` parses the tar stream. A shard that fails to open or read ends there and its unread samples count as skipped; a
sample that fails to decode is counted by the stream that decodes it. Each loader worker keeps one
`SkipCounter`: above `max_skip_fraction` of the samples it has read (once it has read 100), it
raises an error that names the last bad shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import closing

from webdataset.gopen import gopen

from data_prep.layout import DatasetError
from data_prep.storage import is_uri, open_stream
from data_prep.tario import tar_samples

log = logging.getLogger(__name__)
MIN_READ_FOR_SKIP_CHECK = 100  # a fraction of the first few samples says little
READ_BUFFER = 1 << 20
WEBDATASET_SCHEMES = ("http", "https", "file", "pipe", "gs+http")  # what webdataset's gopen opens itself


def open_shard(url: str):
    """A readable binary stream of one shard."""
    if is_uri(url) and url.split("://", 1)[0] not in WEBDATASET_SCHEMES:
        return open_stream(url, READ_BUFFER)
    return gopen(url, "rb", bufsize=READ_BUFFER)


class SkipCounter:
    """Samples read and skipped by one worker; raises once too large a fraction is unreadable."""

    def __init__(self, max_fraction: float, where: str):
        self.max_fraction, self.where = max_fraction, where
        self.read = self.bad = 0
        self.last_bad = ""

    def good(self) -> None:
        self.read += 1
        if self.bad:
            self._check()

    def skip(self, url: str, what: str, exc: BaseException, n: int = 1) -> None:
        self.read += n
        self.bad += n
        self.last_bad = f"{what} in {url}: {type(exc).__name__}: {exc}"
        log.warning("%s: skipping %s", self.where, self.last_bad)
        self._check()

    def finish(self) -> None:
        """The end of a finite pass: the fraction over everything read, however little that was."""
        self._check(minimum=1)

    def _check(self, minimum: int = MIN_READ_FOR_SKIP_CHECK) -> None:
        if self.read >= minimum and self.bad > self.max_fraction * self.read:
            raise DatasetError(
                f"{self.where}: {self.bad} of {self.read} samples read were unreadable "
                f"({self.bad / self.read:.1%} > max_skip_fraction {self.max_fraction:.1%}); "
                f"the last: {self.last_bad}"
            )


def read_shards(
    urls: list[str], counter: SkipCounter, counts: dict[str, int] | None = None
) -> Iterator[dict]:
    """Raw samples of each shard in turn; a shard that fails to open or read (truncated tar,
    missing file) ends there, and its unread samples are counted as skipped."""
    for url in urls:
        n = 0
        try:
            with closing(open_shard(url)) as stream:
                for sample in tar_samples(stream, url):
                    n += 1
                    yield sample
        except Exception as exc:  # any read failure skips the rest of this shard, counted
            lost = max(1, (counts or {}).get(url, 0) - n)
            counter.skip(url, f"{lost} sample(s) after sample {n}", exc, lost)


def count_samples(url: str) -> int:
    """Samples in one shard, by reading it (for URLs without a manifest)."""
    with closing(open_shard(url)) as stream:
        return sum(1 for _ in tar_samples(stream, url))
