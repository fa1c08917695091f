"""A `--ray` build of a Parquet manifest in which two Ray tasks lose their worker process, as they do when a
node is lost: a list task halfway through its range, and a shard task at the item KEY (mid-shard: the
shard's temporary file half written). Each dies once (a flag file in FLAGS marks it) and Ray retries it.

    RAY_ADDRESS=HEAD:PORT python tests/scripts/dying_shard_build.py MANIFEST OUT FLAGS KEY

The source and loader below reach the workers by value (cloudpickle), as a user's own source would.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle

from data_prep import ranged
from data_prep.build import BuildOptions, build_dataset
from data_prep.sources.files import FileLoader
from data_prep.sources.table import ManifestSource


def die_once(flag: Path) -> None:
    """The first time only: the worker process ends at once (no exception, no clean-up)."""
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    os._exit(1)


@dataclass(frozen=True)
class DyingLoader(FileLoader):
    key: str = ""
    flag: str = ""

    def load(self, item, resize_max, quality):
        if item.key == self.key:
            die_once(Path(self.flag))
        return super().load(item, resize_max, quality)


class DyingSource(ManifestSource):
    def __init__(self, path: str, flags: str, key: str):
        super().__init__(path)
        self.flags, self.key = flags, key

    def list_rows(self, spec, first_row, labels=None):
        for i, entry in enumerate(super().list_rows(spec, first_row, labels)):
            if first_row > 0 and i == 5:  # the second range, halfway
                die_once(Path(self.flags) / "list")
            yield entry

    def loader(self) -> DyingLoader:
        return DyingLoader(self.key, str(Path(self.flags) / "shard"))


if __name__ == "__main__":
    manifest, out, flags, key = sys.argv[1:5]
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ranged.RANGE_ROWS = 16  # read on this process (the driver): several ranges
    report = build_dataset(
        DyingSource(manifest, flags, key), out, BuildOptions(max_count=8, use_ray=True, progress=False)
    )
    print(f"wrote {report.num_written} of {report.num_inputs}; died: {sorted(os.listdir(flags))}")
