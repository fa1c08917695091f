"""`vitpipe shard ...`: write a sharded WebDataset corpus in the layout of `data_prep.layout`, or verify one.

vitpipe shard folder DIR OUT [--labels FILE] [--classes NAMES|FILE]
vitpipe shard manifest FILE OUT [--classes NAMES|FILE] [--box-classes NAMES|FILE]   # boxes column: detection
vitpipe shard synthetic OUT --num N --classes C [--labels-per-image 1.3] [--width 500 --height 375]
vitpipe shard synthetic OUT --num N --layout [--objects 6] [--width 500 --height 375]   # + masks, boxes
vitpipe shard digits OUT [--size 32]
vitpipe shard verify OUT [--workers N]

Common options: --max-count, --max-size, --val-fraction, --resize-max, --quality, --workers, --ray,
--max-errors, --seed, --name, --no-progress. A re-run with the same arguments resumes: complete shards
are kept, the rest are written; the result is the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from data_prep.build import BuildOptions, BuildReport, build_dataset
from data_prep.executors import default_workers
from data_prep.layout import ERRORS
from data_prep.sources.digits import DigitsSource
from data_prep.sources.folder import FolderSource
from data_prep.sources.labels import read_classes
from data_prep.sources.synthetic import SyntheticSource
from data_prep.sources.table import ManifestSource
from data_prep.synthetic import LAYOUT_MAX_OBJECTS, LAYOUT_MIN_SIDE
from data_prep.verify import verify_dataset

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def _byte_size(text: str) -> int:
    """`--max-size`: bytes, or with a K/M/G/T suffix (powers of 1024): 512M, 1G, 1.5GiB."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 1000000, 512M or 1G")
    n = float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard needs at least 1 byte")
    return int(n)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"{f}: must be between 0 and 1")
    return f


def _mean_labels(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if f < 1.0:
        raise argparse.ArgumentTypeError(f"{f}: every image has at least one label; use 1 or more")
    return f


def _object_types(text: str) -> int:
    n = _positive(text)
    if not 2 <= n <= LAYOUT_MAX_OBJECTS:
        raise argparse.ArgumentTypeError(f"{n}: use 2..{LAYOUT_MAX_OBJECTS} object types")
    return n


def _shard_name(text: str) -> str:
    if not re.match(r"^[A-Za-z0-9_-]+$", text):
        raise argparse.ArgumentTypeError(f"{text!r}: use letters, digits, '_' or '-'")
    return text


OUT_HELP = "output dataset: a folder, or an object store URI (s3://bucket/prefix, gs://..., credentials from the environment)"


def _common_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sharding")
    g.add_argument("--max-count", type=_positive, default=1000, help="samples per shard (default 1000)")
    g.add_argument("--max-size", type=_byte_size, default=None, help="bytes per shard: 1000000, 512M, 1G")
    g.add_argument(
        "--val-fraction", type=_fraction, default=0.0, help="held-out fraction, by a hash of the key"
    )
    g.add_argument(
        "--resize-max",
        type=_positive,
        default=None,
        metavar="PX",
        help="re-encode images whose longer side is over PX, same format",
    )
    g.add_argument(
        "--quality",
        type=_positive,
        default=95,
        help="JPEG/WebP quality of re-encoded images (resized, converted to RGB/L, turned upright)",
    )
    g.add_argument(
        "--workers", type=_positive, default=default_workers(), help="worker processes (default: all cores)"
    )
    g.add_argument(
        "--ray", action="store_true", help="one Ray task per shard on the cluster at --address (RAY_ADDRESS)"
    )
    g.add_argument(
        "--address",
        default=None,
        help="with --ray: the cluster, in the forms `vitpipe submit` takes: its Jobs API "
        "(http://HEAD:8265; the command then runs there as a Ray job, its log streamed here), or its GCS "
        "(HEAD:6379) to drive the tasks from here (default $RAY_ADDRESS, else a cluster started on this "
        "machine)",
    )
    g.add_argument(
        "--python",
        default="python",
        help="with a Jobs API --address: the interpreter on the cluster that has vitpipe's dependencies",
    )
    g.add_argument(
        "--max-errors",
        type=_fraction,
        default=0.1,
        metavar="FRACTION",
        help="fail if more than this fraction of inputs is rejected (default 0.1)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="generator seed (synthetic); shard order and split salt (others)"
    )
    g.add_argument(
        "--name", type=_shard_name, default="shard", help="shard file prefix: OUT/SPLIT/NAME-000000.tar"
    )
    g.add_argument(
        "--scratch",
        default=None,
        metavar="DIR",
        help="local work folder when OUT is object storage (a folder per dataset under DIR; default: the "
        "system temp dir)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(
        name=args.name,
        max_count=args.max_count,
        max_size=args.max_size,
        val_fraction=args.val_fraction,
        resize_max=args.resize_max,
        quality=args.quality,
        workers=args.workers,
        use_ray=args.ray,
        max_errors=args.max_errors,
        seed=args.seed,
        progress=args.progress,
        scratch=args.scratch,
    )


def _print_report(r: BuildReport) -> int:
    rate = (r.num_new / r.seconds) if r.seconds > 0 else 0.0
    resumed = f"; {r.resumed_shards} shards already complete, kept" if r.resumed_shards else ""
    print(
        f"wrote {r.num_written} images in {r.num_shards} shards to {r.out.describe()} in {r.seconds:.1f} s "
        f"({rate:.0f} images/s{resumed}): {dict(sorted(r.totals.items()))}"
    )
    if r.num_errors:
        top = ", ".join(f"{n} {kind}" for kind, n in sorted(r.reasons.items(), key=lambda kv: -kv[1])[:4])
        print(f"rejected {r.num_errors} of {r.num_inputs} inputs ({top}); listed in {r.out.describe(ERRORS)}")
    if r.over_size:
        print(
            f"warning: {len(r.over_size)} shards exceed --max-size (re-encoded or generated images were "
            f"larger than estimated): {', '.join(r.over_size[:5])}",
            file=sys.stderr,
        )
    if r.failure:
        print(f"vitpipe shard: {r.failure}", file=sys.stderr)
        return 1
    return 0


def _run(source, args: argparse.Namespace) -> int:
    # Where the command ran is not an option of the dataset (a re-run elsewhere resumes the same build).
    options = {
        k: v for k, v in vars(args).items() if k not in ("func", "command", "parser", "address", "python")
    }
    if args.ray and args.address:
        os.environ["RAY_ADDRESS"] = args.address  # a GCS address (a Jobs API one ran as a job: vitpipe.py)
    command = "vitpipe " + shlex.join(sys.argv[1:])
    return _print_report(build_dataset(source, args.out, _options(args), command=command, options=options))


def _class_list(args: argparse.Namespace):
    return read_classes(args.classes) if args.classes else None


def _folder(args: argparse.Namespace) -> int:
    return _run(FolderSource(args.dir, args.labels, _class_list(args), seed=args.seed), args)


def _manifest(args: argparse.Namespace) -> int:
    boxes = read_classes(args.box_classes) if args.box_classes else None
    return _run(ManifestSource(args.file, _class_list(args), seed=args.seed, box_classes=boxes), args)


def _synthetic(args: argparse.Namespace) -> int:
    if args.layout and args.classes is not None:
        args.parser.error(
            f"--classes does not apply with --layout: its classes follow from --objects "
            f"(3 * {args.objects} + 4 = {3 * args.objects + 4})"
        )
    if not args.layout and args.classes is None:
        args.parser.error("--classes is required (or --layout)")
    if args.layout and min(args.width, args.height) < LAYOUT_MIN_SIDE:
        args.parser.error(
            f"--layout needs images of at least {LAYOUT_MIN_SIDE} px on the shorter side, got "
            f"{args.width}x{args.height}"
        )
    source = SyntheticSource(
        args.num,
        args.classes,
        seed=args.seed,
        labels_per_image=args.labels_per_image,
        width=args.width,
        height=args.height,
        layout=args.layout,
        objects=args.objects,
    )
    return _run(source, args)


def _digits(args: argparse.Namespace) -> int:
    return _run(DigitsSource(args.size, seed=args.seed), args)


def _verify(args: argparse.Namespace) -> int:
    checks = verify_dataset(args.out, workers=args.workers)
    shown = args.out.split("?", 1)[0]  # an object store URI's query (endpoint) is not worth printing
    bad = [c for c in checks if c.problems]
    for c in bad:
        for p in c.problems:
            print(p, file=sys.stderr)
    shards = [c for c in checks if c.shard.endswith(".tar")]
    samples = sum(c.samples for c in shards)
    if bad:
        print(f"vitpipe shard verify: {len(bad)} of {len(checks)} files bad in {shown}", file=sys.stderr)
        return 1
    print(f"verified {len(shards)} shards, {samples} samples in {shown}: all OK")
    return 0


def add_shard_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("shard", help="write a sharded WebDataset corpus, or verify one")
    src = p.add_subparsers(dest="source", required=True, metavar="SOURCE")
    common = [_common_options()]

    s = src.add_parser(
        "folder", parents=common, help="an image folder: DIR/CLASS/IMAGE, or flat with --labels"
    )
    s.add_argument(
        "dir", help="input folder (DIR/CLASS/IMAGE), or a bucket prefix in that layout (s3://bucket/prefix)"
    )
    s.add_argument("out", help=OUT_HELP)
    s.add_argument(
        "--labels",
        help="CSV (columns file, label|labels; read by the workers in spans) or JSON (read whole): file name "
        "(relative to DIR) -> label or list of labels",
    )
    s.add_argument(
        "--classes", help="class names in order: a,b,c or a file (one per line); others are rejected"
    )
    s.set_defaults(func=_folder)

    s = src.add_parser(
        "manifest",
        parents=common,
        help="a Parquet/CSV table: path, label|labels [, split, key] [, boxes, box_labels]",
    )
    s.add_argument(
        "file", help="manifest file (.parquet, .csv, .tsv); relative paths resolve against its folder"
    )
    s.add_argument("out", help=OUT_HELP)
    s.add_argument(
        "--classes", help="class names in order: a,b,c or a file (one per line); others are rejected"
    )
    s.add_argument(
        "--box-classes",
        help="detection class names in order (a,b,c or a file) for the boxes column's box_labels; others are "
        "rejected (default: the distinct box labels, sorted)",
    )
    s.set_defaults(func=_manifest)

    s = src.add_parser("synthetic", parents=common, help="a generated JFT-like multi-label corpus")
    s.add_argument("out", help=OUT_HELP)
    s.add_argument("--num", type=_positive, required=True, help="images to generate")
    s.add_argument(
        "--classes", type=_positive, default=None, help="number of classes (required without --layout)"
    )
    s.add_argument(
        "--labels-per-image",
        type=_mean_labels,
        default=1.3,
        help="mean labels per image (>= 1; not with --layout)",
    )
    s.add_argument("--width", type=_positive, default=500, help="ImageNet-like default 500x375")
    s.add_argument("--height", type=_positive, default=375)
    s.add_argument(
        "--layout",
        action="store_true",
        help="the layout corpus: labels say where objects are ({type}_top/_bottom, {type}_left_of_{next}, "
        "crowded_{tl,tr,bl,br}: 3 * objects + 4 classes) and each image's object mask is stored as KEY.seg.png, "
        "its objects' boxes and types as KEY.boxes.json",
    )
    s.add_argument(
        "--objects",
        type=_object_types,
        default=6,
        help=f"object types of the layout corpus (2..{LAYOUT_MAX_OBJECTS}, default 6)",
    )
    s.set_defaults(func=_synthetic, parser=s)

    s = src.add_parser(
        "digits", parents=common, help="scikit-learn's bundled 8x8 digits (1,797), upsampled PNG"
    )
    s.add_argument("out", help=OUT_HELP)
    s.add_argument("--size", type=_positive, default=32, help="side of the stored images (default 32)")
    s.set_defaults(func=_digits)

    s = src.add_parser("verify", help="re-read every shard: counts, sha256, every image decodes")
    s.add_argument("out", help="dataset folder or object store URI")
    s.add_argument(
        "--workers", type=_positive, default=default_workers(), help="processes (default: all cores)"
    )
    s.set_defaults(func=_verify)
    return p
