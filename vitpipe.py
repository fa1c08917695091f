"""`vitpipe`: the command-line dispatcher, the only module that knows data_prep, pipeline and cluster.

Each sub-command's arguments and code live in the package that owns it; this module wires them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _train(args: argparse.Namespace) -> int:
    from pipeline.config import check_inputs, load_config

    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg)  # the dataset, before Ray, torchrun or the engine starts
    if cfg.cluster.launcher == "ray":
        from cluster.run import run_stage

        try:
            result = run_stage(cfg)
            error = result.error
        except Exception as exc:  # Ray Train v2 raises TrainingFailedError once retries are exhausted
            result, error = None, exc
        if error is not None:
            print(f"training failed: {error}", file=sys.stderr)
            return 1
        if result.checkpoint is not None:  # a pointer to the export (cluster.run.report)
            kind = getattr(result.checkpoint.filesystem, "type_name", "local")
            where = result.checkpoint.path if kind == "local" else f"{kind}://{result.checkpoint.path}"
            print(f"Ray Train checkpoint: {where} (export.json: where the export is)")
    else:
        from pipeline.train.launch import launch_local

        launch_local(cfg)
    print(f"run directory: {cfg.run_path}\nMLflow: {cfg.tracking_uri}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from cluster.run import run_experiment
    from pipeline.config import check_inputs, load_experiment

    exp = load_experiment(args.config, args.overrides)
    check_inputs(exp)  # every stage's dataset, before Ray or any worker starts
    return run_experiment(exp)


def _shard_as_job(args: argparse.Namespace, argv: list[str]) -> int | None:
    """`vitpipe shard ... --ray` with a Jobs API address (http://HEAD:8265, as `vitpipe submit` takes it):
    submit the same command as a Ray job and stream its log; None when it runs here."""
    from cluster.submit import follow, is_jobs_api, submit_shard

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not (getattr(args, "ray", False) and is_jobs_api(address)):
        return None
    rest, skip = [], False
    for arg in argv:  # the command line without the options that only say where it runs
        if skip:
            skip = False
        elif arg in ("--address", "--python"):
            skip = True
        elif not arg.startswith(("--address=", "--python=")):
            rest.append(arg)
    outputs = {"OUT": args.out, "--scratch": args.scratch}
    named = {
        "DIR": "dir",
        "FILE": "file",
        "--labels": "labels",
        "--classes": "classes",
        "--box-classes": "box_classes",
    }
    inputs = {k: getattr(args, a, None) for k, a in named.items()}
    inputs = {
        k: v
        for k, v in inputs.items()
        if v and (k not in ("--classes", "--box-classes") or os.path.isfile(v))
    }
    sid = submit_shard(rest, outputs, inputs, address, args.python)
    print(
        f"submitted {sid} to {address}\n  logs: vitpipe logs {sid} --follow\n  stop: vitpipe stop {sid}",
        flush=True,
    )
    status = follow(sid, address)
    print(f"job {sid}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def build_parser() -> argparse.ArgumentParser:
    from cluster.cli import add_cluster_parsers
    from data_prep.cli import add_shard_parser
    from pipeline.cli import add_compare_parser, add_train_parser

    parser = argparse.ArgumentParser(prog="vitpipe", description="Pretrain Vision Transformers at scale.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_shard_parser(sub)
    add_train_parser(sub).set_defaults(func=_train)
    add_compare_parser(sub)
    run = sub.add_parser("run", help="run an experiment's stages in order on Ray (this shell is the driver)")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    run.set_defaults(func=_run)
    add_cluster_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cluster.submit import SubmitError
    from data_prep.layout import DatasetError
    from pipeline.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "shard" and args.source != "verify":
            as_job = _shard_as_job(args, argv)
            if as_job is not None:
                return as_job
        return int(args.func(args) or 0)
    except (ConfigError, DatasetError, SubmitError) as exc:
        print(f"vitpipe {args.command}: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # no cluster at the address, or the token was refused
        print(f"vitpipe {args.command}: cannot reach the Ray cluster: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
