"""Arguments of the cluster's sub-commands: `vitpipe run / submit / jobs / logs / stop`."""

from __future__ import annotations

import argparse
import sys

from cluster import submit  # Ray itself loads only when a command talks to the cluster

ADDRESS_HELP = (
    "Ray Jobs API address (the dashboard), e.g. http://HEAD:8265; default $RAY_ADDRESS or 127.0.0.1:8265"
)


def _submit(args: argparse.Namespace) -> int:
    env = dict(kv.split("=", 1) for kv in args.env)
    sid = submit.submit(args.config, args.overrides, args.address, python=args.python, env=env)
    print(f"submitted {sid}\n  logs: vitpipe logs {sid} --follow\n  stop: vitpipe stop {sid}", flush=True)
    if not args.follow:
        return 0
    status = submit.follow(sid, args.address)
    print(f"job {sid}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _jobs(args: argparse.Namespace) -> int:
    rows = submit.list_jobs(args.address)
    if not rows:
        print("no jobs")
    for r in rows:
        print(f"{r['id']:<40} {r['status']:<10} {r['start']}  {r['entrypoint']}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    if args.follow:
        status = submit.follow(args.id, args.address)
        print(f"job {args.id}: {status}")
        return 0
    sys.stdout.write(submit.logs(args.id, args.address))
    return 0


def _stop(args: argparse.Namespace) -> int:
    stopped = submit.stop(args.id, args.address)
    print(f"{args.id}: {'stop requested' if stopped else 'not running'}")
    return 0


def add_cluster_parsers(sub) -> None:
    p = sub.add_parser("submit", help="submit an experiment to a Ray cluster (Jobs API)")
    p.add_argument("config", help="experiment YAML inside this project, e.g. configs/experiments/demo.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--address", help=ADDRESS_HELP)
    p.add_argument(
        "--follow", action="store_true", help="stream the logs until the job ends; exit 1 unless it succeeded"
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra runtime environment variable"
    )
    p.add_argument(
        "--python", default="python", help="the interpreter on the cluster that has vitpipe's dependencies"
    )
    p.set_defaults(func=_submit)
    j = sub.add_parser("jobs", help="list the cluster's jobs")
    j.add_argument("--address", help=ADDRESS_HELP)
    j.set_defaults(func=_jobs)
    lg = sub.add_parser("logs", help="print (or --follow) a job's logs")
    lg.add_argument("id")
    lg.add_argument("--address", help=ADDRESS_HELP)
    lg.add_argument("--follow", action="store_true")
    lg.set_defaults(func=_logs)
    s = sub.add_parser("stop", help="stop a job: the running stage checkpoints, then the job ends")
    s.add_argument("id")
    s.add_argument("--address", help=ADDRESS_HELP)
    s.set_defaults(func=_stop)
