"""Which edges of a lowered plan go through shared memory: a node whose
readers on other workers all share its memory domain (one host) publishes its
value there (:class:`flowreduce.kernels.shm.Publish`), so Dask moves a
handle. Same-worker readers keep the array; a node read across hosts keeps
Dask's comm. Imports dask, never distributed."""

from __future__ import annotations

from collections.abc import Sequence

from dask.task_spec import Task

from flowreduce import keys
from flowreduce.algorithms.ir import Plan
from flowreduce.kernels.shm import Publish
from flowreduce.lower.graph import Graph


def published_nodes(plan: Plan, workers: Sequence[str], domains: Sequence[object | None]) -> set[int]:
    """Nodes to publish: read by another worker, and only by workers of the
    node's own memory domain (``domains[r]``: rank r's host, None when its
    worker cannot use shared memory)."""
    nodes, consumers = plan.nodes, plan.consumers()
    out = set()
    for n in nodes:
        here, dom = workers[n.rank], domains[n.rank]
        remote = [nodes[c].rank for c in consumers[n.id] if workers[nodes[c].rank] != here]
        if dom is not None and remote and all(domains[r] == dom for r in remote):
            out.add(n.id)
    return out


def publish(graph: Graph, nodes: set[int]) -> Graph:
    """``graph`` with the tasks of ``nodes`` (all chunks) publishing their
    values. Rank outputs are never published: they stay ordinary arrays."""
    if not nodes:
        return graph
    tasks = dict(graph.tasks)
    for key, task in graph.tasks.items():
        parts = keys.parse(key)
        if parts is not None and parts.get("node") in nodes:
            tasks[key] = Task(key, Publish(task.func, repr(key), parts["token"]), *task.args, **task.kwargs)
    return Graph(tasks, graph.outputs, graph.placement, graph.token)
