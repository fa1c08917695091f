"""Start and stop a local Ray cluster on this machine: a head plus worker nodes, token auth on, 127.0.0.1.

Every node's address is 127.0.0.1, so every socket of the cluster listens on loopback only
(docs/security.md); the nodes are told apart by their Ray node IDs (cluster.process_group numbers a
stage's local ranks by them).

python -m cluster.local start --worker-nodes 1      # prints RAY_ADDRESS and the Jobs API URL
python -m cluster.local stop

On a GPU machine the head offers its GPUs and the other nodes none (one node per device): a GPU stage's
workers all run on the head.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil  # installed with ray[default]

from data_prep.executors import RAY_MULTI_NODE_SWITCH


@dataclass(frozen=True)
class LocalCluster:
    address: str  # GCS address for ray.init / cluster.address
    dashboard_url: str  # Jobs API address for `ray job submit --address`
    temp_dir: str


def _ray_bin() -> str:
    # The `ray` next to this interpreter, so workers import the same environment.
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else (shutil.which("ray") or "ray")


# `ray start` with the node address kept as given. Ray's C++ servers (GCS, raylet, workers) and its agents
# listen on loopback only when the node's address is exactly 127.0.0.1, and on every interface otherwise;
# Ray replaces 127.0.0.1 with the machine's address (ray._private.services.resolve_ip_for_localhost) unless
# its multi-node switch (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) is off, and with the switch off `ray start`
# refuses to join a cluster. So the CLI runs with the switch on (read at import) and that one replacement
# turned off, and hands the switch, off, to the daemons it starts (their agents, the workers and job
# drivers they start would otherwise look for the GCS at the machine's address). Only for a loopback node:
# on a node with a network address, processes find their node by that address.
_RAY_START_AS_GIVEN = """
import os, sys
from ray._private import ray_constants, services
ray_constants.ENABLE_RAY_CLUSTER = True  # whatever the environment says: a node may join
services.resolve_ip_for_localhost = lambda host: host
if sys.argv[sys.argv.index("--node-ip-address") + 1] == "127.0.0.1":
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
else:
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
"""


def _ray_start(*args: str) -> list[str]:
    """The command line of `ray start ARGS` that keeps --node-ip-address as given (see above)."""
    return [sys.executable, "-c", _RAY_START_AS_GIVEN, "start", *args]


def auth_env() -> dict[str, str]:
    """Client environment for a local cluster: token authentication (token from ~/.ray/auth_token by
    default), and 127.0.0.1 kept as it is (RAY_MULTI_NODE_SWITCH off), where the cluster listens."""
    return {**os.environ, "RAY_AUTH_MODE": "token", RAY_MULTI_NODE_SWITCH: "0"}


def free_ports(n: int) -> list[int]:
    """`n` different free ports: each socket stays bound until all are chosen (one at a time, the system
    may hand out a port just released again: seen as `ray start` refusing one port for two components)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


NODE_PORT_FLAGS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--ray-client-server-port",
)


def _node_ports(ports: list[int] | None = None) -> list[str]:
    """Free ports for a node's agents: their fixed defaults (e.g. 52365) collide when two Ray
    clusters share a machine, and the second cluster's job agent then never comes up."""
    ports = ports or free_ports(len(NODE_PORT_FLAGS))
    return [part for flag, port in zip(NODE_PORT_FLAGS, ports) for part in (flag, str(port))]


def ensure_token() -> None:
    """Token authentication needs a token before the head starts; make one for this user if none exists."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if (Path.home() / ".ray" / "auth_token").is_file():
        return
    proc = subprocess.run(
        [_ray_bin(), "get-auth-token", "--generate"], env=auth_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"could not generate a Ray auth token: {proc.stderr.strip()}")
    (Path.home() / ".ray" / "auth_token").chmod(0o600)  # a credential: readable by this user only


def start_head(
    temp_dir: str, num_cpus: int = 4, include_dashboard: bool = True, node_ip: str = "127.0.0.1"
) -> LocalCluster:
    """The head node. `node_ip`: its address, 127.0.0.1 by default (every socket on loopback); another
    address (this machine's on a network other machines can join from) makes Ray listen on every interface.
    The dashboard and Jobs API stay on 127.0.0.1 either way (reach them through an SSH tunnel)."""
    ensure_token()
    ports: list[int] = []

    def command() -> tuple[list[str], str]:
        ports[:] = free_ports(2 + len(NODE_PORT_FLAGS))
        port, dash, *agents = ports
        cmd = _ray_start(
            "--head",
            "--node-ip-address",
            node_ip,
            "--port",
            str(port),
            "--num-cpus",
            str(num_cpus),
            "--temp-dir",
            temp_dir,
            "--include-dashboard",
            str(include_dashboard).lower(),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dash),
            "--disable-usage-stats",
            *_node_ports(agents),
        )
        return cmd, f"{node_ip}:{port}"

    _start(command, temp_dir)
    return LocalCluster(f"{node_ip}:{ports[0]}", f"http://127.0.0.1:{ports[1]}", temp_dir)


# `ray start` waits a fixed 30 s for its raylet to register with the GCS; a machine busy enough passes that
# (seen on CI: "The current node timed out during startup"), and the same start a moment later succeeds.
START_ATTEMPTS = 3


def _start(command: Callable[[], tuple[list[str], str | None]], temp_dir: str) -> None:
    """Run the `ray start` that `command()` makes (fresh ports on each call), with the address of the
    cluster it starts or joins. When it fails, stop what it had started (a GCS server, a log monitor):
    left running, they hold ports and make the next start on this machine time out. A start that timed
    out waiting for its raylet is made again, up to START_ATTEMPTS times; any other failure raises at once.

    The node's daemons and every worker inherit RAY_ADDRESS naming its cluster: Ray Train's placement-group
    cleaner queries the state API without an address, and on a machine with several local clusters (the
    test suite) that lookup found them all and its thread died ("Found multiple active Ray instances"),
    leaving a dead controller's resources held."""
    for attempt in range(1, START_ATTEMPTS + 1):
        cmd, address = command()
        env = {**auth_env(), **({"RAY_ADDRESS": address} if address else {})}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            return
        _terminate(f"{os.path.abspath(temp_dir)}/")
        timed_out = "timed out during startup" in proc.stdout + proc.stderr
        if not timed_out or attempt == START_ATTEMPTS:
            tried = f" (attempt {attempt} of {START_ATTEMPTS})" if timed_out else ""
            shown = " ".join(cmd).replace(f"{sys.executable} -c {_RAY_START_AS_GIVEN}", "ray")
            raise RuntimeError(f"`{shown}` failed ({proc.returncode}){tried}:\n{proc.stdout}\n{proc.stderr}")
        print(
            f"ray start timed out waiting for its raylet (attempt {attempt}); starting it again",
            file=sys.stderr,
        )


# A cluster's GCS server and autoscaler monitor outlive SIGTERM (measured: still running 15 s after it); the
# rest exit within a second. The GCS holds nothing that outlives the cluster, so they are killed after this.
STOP_GRACE_S = 5


def _terminate(marker: str, at_once: bool = False) -> None:
    """Terminate (then kill, after STOP_GRACE_S; `at_once`: kill now) every other process whose command
    line contains `marker`, and every descendant of one: a raylet's agents retitle themselves
    (`ray::DashboardAgent`), so their command lines name no session, and killed after their raylet they
    lived on as orphans."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and marker in " ".join(p.info["cmdline"] or []):
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True) if c.pid != os.getpid())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    procs = list(found.values())
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill() if at_once else p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=15)  # gone when this returns, not only signalled


def add_worker_node(
    cluster: LocalCluster,
    num_cpus: int = 2,
    name: str = "worker1",
    own_disk: tuple[str, str] | None = None,
    node_ip: str | None = None,
) -> None:
    """A second Ray node on this machine (its own raylet, CPUs and temp dir; no GPU: the head offers this
    machine's), joined to the head.

    Its own temp dir matters: two raylets sharing one session folder garbage-collect each other's
    runtime-env packages, deleting a running job's working directory. Its address is the head's unless
    `node_ip` says otherwise: with both on 127.0.0.1, every socket of the node is on loopback.

    `own_disk=(PATH, FOLDER)`: the node and every process it starts see FOLDER at PATH (a private mount
    namespace, `unshare --mount`, needs root), while the head and the driver see the real PATH: two nodes
    with their own local disks at the same paths, as on a GPU cluster with node-local NVMe.
    """
    if node_ip is None:
        node_ip = cluster.address.rpartition(":")[0]
    if own_disk is not None:
        Path(own_disk[0]).mkdir(parents=True, exist_ok=True)
        Path(own_disk[1]).mkdir(parents=True, exist_ok=True)
    _start(
        lambda: (_worker_command(cluster, num_cpus, name, own_disk, node_ip), cluster.address),
        f"{cluster.temp_dir}-{name}",
    )


def _worker_command(
    cluster: LocalCluster, num_cpus: int, name: str, own_disk: tuple[str, str] | None, node_ip: str
) -> list[str]:
    cmd = _ray_start(
        "--address",
        cluster.address,
        "--node-ip-address",
        node_ip,
        "--temp-dir",
        f"{cluster.temp_dir}-{name}",
        "--num-cpus",
        str(num_cpus),
        "--resources",
        json.dumps({f"node:{name}": 1}),
        # The head already offers this machine's GPUs: a raylet counts every GPU it sees, so a second node
        # on the same machine would offer the same devices again, and a stage's workers on both nodes would
        # each be given "GPU 0" (NCCL: duplicate GPU). GPU stages run their workers on the head.
        "--num-gpus",
        "0",
        "--disable-usage-stats",
        *_node_ports(),
    )
    if own_disk is None:
        return cmd
    path, folder = own_disk
    # `ray start` returns once its daemons run; they keep the namespace (and the mount) alive.
    mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", folder, path, *cmd]


def kill_node(cluster: LocalCluster, name: str = "worker1") -> None:
    """A node of `cluster` dies: SIGKILL to its raylet, its agents and every worker it runs, at once (what
    a lost machine looks like to the rest of the cluster). `add_worker_node` with the same name brings one
    back."""
    _terminate(f"{cluster.temp_dir}-{name}/", at_once=True)


def stop(cluster: LocalCluster | None = None) -> None:
    """Stop `cluster`'s processes only (head and its nodes share one session name); None stops all of Ray."""
    if cluster is None:
        subprocess.run([_ray_bin(), "stop", "--force"], env=auth_env(), capture_output=True, text=True)
        return
    _terminate(Path(cluster.temp_dir, "session_latest").resolve().name)  # session_2026-..._PID


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.local", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--temp-dir", default="/tmp/vitpipe-ray")
    s.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2, help="CPUs of each node")
    s.add_argument("--worker-nodes", type=int, default=1, help="extra Ray nodes on this machine")
    s.add_argument(
        "--node-ip-address",
        default="127.0.0.1",
        help="the nodes' address (default 127.0.0.1: every socket on loopback only); this machine's address "
        "on a network lets other machines' `ray start --address` join, and Ray then listens on every "
        "interface (docs/security.md)",
    )
    s.add_argument(
        "--own-disk",
        metavar="PATH",
        help="give each extra node its own folder at PATH (PATH.NODE bind-mounted there; needs root): "
        "a rehearsal of nodes that share no disk",
    )
    sub.add_parser("stop")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "start":
        c = start_head(args.temp_dir, args.num_cpus, node_ip=args.node_ip_address)
        for i in range(args.worker_nodes):
            node = f"worker{i + 1}"
            disk = (args.own_disk, f"{args.own_disk.rstrip('/')}.{node}") if args.own_disk else None
            add_worker_node(c, args.num_cpus, node, own_disk=disk)
        print(
            f"RAY_ADDRESS={c.address}\nJobs API: {c.dashboard_url}\nclients need RAY_AUTH_MODE=token "
            f"(and {RAY_MULTI_NODE_SWITCH}=0 for Ray's own CLI at {c.address}: Ray would replace 127.0.0.1 "
            "with this machine's address, where nothing listens)"
        )
    else:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
