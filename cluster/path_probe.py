"""Which of the paths in PATHS.json each live node of a Ray cluster lacks, with the node's resources.

Run by `vitpipe submit` as a Ray job of its own, whose working directory is this file and the list alone,
before the project is uploaded (`cluster.submit.check_datasets_on_cluster`): it imports nothing but Ray,
since the cluster may not have vitpipe on its path. Prints one line, PREFIX + JSON:
[{"node": ADDRESS, "id": NODE_ID, "resources": {...}, "missing": [PATH, ...]}, ...]; `missing` is null for
a node that did not answer within the timeout.

    python path_probe.py PATHS.json
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = "VITPIPE_PATH_PROBE "
ANSWER_TIMEOUT_S = 120


def _missing(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.path.exists(p)]


def main(listing: str) -> None:
    import ray  # here: `vitpipe submit` imports this module for PREFIX, and Ray takes seconds to import
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with open(listing) as f:
        paths = json.load(f)
    ray.init()
    # num_cpus=0: runs beside a busy node's work, and on a head that schedules no training
    missing = ray.remote(num_cpus=0)(_missing)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    refs = [
        missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            paths
        )
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ANSWER_TIMEOUT_S)
    report = [
        {
            "node": n["NodeManagerAddress"],
            "id": n["NodeID"],
            "resources": n["Resources"],
            "missing": ray.get(r) if r in ready else None,
        }
        for n, r in zip(nodes, refs)
    ]
    print(PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
