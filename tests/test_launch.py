"""``flowreduce.launch`` without a batch system: rank groups from where
workers run."""

from __future__ import annotations

# ---------------------------------------------------------------- rank groups


def test_groups_are_the_nodes_whatever_the_jobs():
    from flowreduce.schedule import _groups_by_place

    # (node, cpus, job, host): jobs 7 and 8 both on node n1, job 9 across n2 and n3
    places = {"a": ("n1", 8, "7", "n1"), "b": ("n1", 8, "8", "n1"), "c": ("n2", 8, "9", "n2"),
              "d": ("n3", 8, "9", "n3"), "e": ("n1", 8, "7", "n1"), "f": ("n2", 8, "9", "n2")}
    # two jobs on one node: one group; one job on two nodes: two groups
    assert _groups_by_place(["a", "b"], places) == [[0, 1]]
    assert _groups_by_place(["c", "d"], places) == [[0], [1]]
    # interleaved ranks: groups in order of their first rank, ranks in rank order
    assert _groups_by_place(["c", "a", "d", "b", "f", "e"], places) == [[0, 4], [1, 3, 5], [2]]
    # a worker nobody located is a node of its own
    assert _groups_by_place(["a", "zz", "b"], places) == [[0, 2], [1]]
