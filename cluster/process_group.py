"""Ray Train's torch process group, with its store listening on one address: the rank-0 worker's node IP.

    TorchTrainer(..., torch_config=NodeAddressTorchConfig(backend="gloo"))

Ray Train's own set-up (`ray.train.torch.TorchConfig`) has every worker call `init_process_group` with
env:// or tcp://, and torch's TCP store then listens on every interface of rank 0's node, whatever
MASTER_ADDR says (docs/security.md). Here rank 0 binds a socket to its node's Ray address first (127.0.0.1
in the private local Ray that `vitpipe run` starts; the cluster network's address on a real node) and
hands it to the store as `master_listen_fd`; the others connect to that address; each rank then joins the
process group through the store.

Local ranks (LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK) count the workers on each Ray node (by node ID), not
on each node address as Ray Train does: the nodes of a local cluster all have the address 127.0.0.1
(cluster.local), and a node's first local rank tends its own disk. On a real cluster, one address per node,
both give the same numbers. The rest is Ray Train's: backend choice, the other torch environment
variables, the shutdown.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch.distributed as dist
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

# rank 0's bound socket, between _listen (run first on rank 0) and _join (run next on every rank)
_listening: socket.socket | None = None


def _listen() -> tuple[str, int]:
    """On rank 0: a socket bound to this node's Ray address and listening; its address and port."""
    global _listening
    addr = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(1024)
    _listening = sock
    return addr, sock.getsockname()[1]


def _join(backend: str, world_rank: int, world_size: int, addr: str, port: int, timeout_s: int) -> None:
    """On every rank: the store (rank 0 serves it on the socket _listen bound), then the process group."""
    global _listening
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))  # for code that reads them
    if backend == "nccl":  # as Ray Train does: fail on a timed-out collective instead of hanging
        if not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    listen_fd = None
    if world_rank == 0:
        if _listening is None:
            raise RuntimeError(f"rank 0 at {addr}: the store's socket was not bound before joining")
        listen_fd, _listening = _listening.detach(), None  # the store owns the descriptor from here
    store = dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=world_rank == 0,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listen_fd,
    )
    dist.init_process_group(
        backend, store=store, rank=world_rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _set_local_ranks(local_rank: int, local_world_size: int, node_rank: int) -> None:
    os.environ.update(
        LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size), NODE_RANK=str(node_rank)
    )


def local_ranks(node_ids: list[str]) -> list[tuple[int, int, int]]:
    """(local rank, local world size, node rank) of each world rank, given each rank's node ID. Ray Train
    numbers ranks node by node, so a node's ranks are consecutive; this does not rely on it."""
    node_rank = {node: i for i, node in enumerate(dict.fromkeys(node_ids))}  # in order of first rank
    size = Counter(node_ids)
    seen: Counter = Counter()
    out = []
    for node in node_ids:
        out.append((seen[node], size[node], node_rank[node]))
        seen[node] += 1
    return out


class _NodeAddressBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: NodeAddressTorchConfig) -> None:
        backend = backend_config.backend or "gloo"
        addr, port = worker_group.execute_single(0, _listen)
        if not isinstance(worker_group, V1WorkerGroup):  # Ray Train v1 sets them itself later
            worker_group.execute(_set_torch_distributed_env_vars)  # RANK, LOCAL_RANK, WORLD_SIZE, ...
        n = len(worker_group)
        ranks = local_ranks(worker_group.execute(_node_id))
        ray.get([worker_group.execute_single_async(i, _set_local_ranks, *ranks[i]) for i in range(n)])
        ray.get(
            [
                worker_group.execute_single_async(
                    i,
                    _join,
                    backend=backend,
                    world_rank=i,
                    world_size=n,
                    addr=addr,
                    port=port,
                    timeout_s=backend_config.timeout_s,
                )
                for i in range(n)
            ]
        )


@dataclass
class NodeAddressTorchConfig(TorchConfig):
    """TorchConfig whose process group's store listens on rank 0's node address only."""

    @property
    def backend_cls(self):
        return _NodeAddressBackend
