"""Everything that writes and checks datasets, and the one definition of their layout.

layout.py        manifest.json, index.parquet columns, errors.parquet, shard and sidecar paths (the loader reads this)
atomic.py        the one atomic file write (tmp, fsync, rename)
tario.py         the one tar implementation: deterministic members (writing), a streaming parser (reading)
keys.py          sample keys from paths, the train/val hash split, the shard order hash
images.py        check, resize and re-encode one image
sources/         folder, manifest table, synthetic, digits: listing (driver) and loading (workers)
plan.py          listing -> shard tasks, before any image is read (on the driver)
ranged.py        a Parquet manifest planned by tasks: ranges listed, buckets sorted, shards as slices
shard_file.py    samples -> one complete shard and its index rows: the only code that writes a shard
shard_worker.py  one task -> one complete shard and its sidecar (the code every worker runs)
index.py         index.parquet's schema, writer and reader (a folder of parts and its _metadata)
executors.py     tasks in this process, in worker processes, or as Ray tasks
build.py         `vitpipe shard SOURCE`: plan, write, then index, errors and manifest
verify.py        `vitpipe shard verify`
writer.py        the small in-process writer (`write_dataset`) the training launcher and tests use
synthetic.py     the generated JFT-like corpus
cli.py           the `vitpipe shard` argument parser

Imports neither `pipeline` nor `cluster`; Ray only inside `executors.Executor` (`--ray`).
"""
