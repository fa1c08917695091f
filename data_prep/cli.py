"""`vitpipe shard ...`: write datasets in the layout of `data_prep.layout`."""

from __future__ import annotations

import argparse
import time

from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset


def _synthetic(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    samples = synthetic_samples(
        args.num, args.classes, seed=args.seed, labels_per_image=args.labels_per_image,
        width=args.width, height=args.height, val_fraction=args.val_fraction,
    )  # fmt: skip
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command", "source")}
    manifest = write_dataset(
        args.out,
        samples,
        class_names(args.classes),
        multi_label=True,
        max_count=args.max_count,
        options=options,
    )
    dt = time.perf_counter() - t0
    n = sum(manifest.totals.values())
    print(
        f"wrote {n} images in {len(manifest.shards)} shards to {args.out} ({n / dt:.0f} images/s): {manifest.totals}"
    )
    return 0


def add_shard_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("shard", help="write a sharded WebDataset corpus")
    src = p.add_subparsers(dest="source", required=True, metavar="SOURCE")
    s = src.add_parser("synthetic", help="a generated JFT-like multi-label corpus")
    s.add_argument("out", help="output dataset folder")
    s.add_argument("--num", type=int, required=True, help="images to generate")
    s.add_argument("--classes", type=int, required=True, help="number of classes")
    s.add_argument("--labels-per-image", type=float, default=1.3, help="mean labels per image")
    s.add_argument("--width", type=int, default=500)
    s.add_argument("--height", type=int, default=375)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-count", type=int, default=1000, help="samples per shard")
    s.add_argument("--val-fraction", type=float, default=0.0, help="held-out fraction (hash of the key)")
    s.set_defaults(func=_synthetic)
    return p
