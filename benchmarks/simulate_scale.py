"""Past this machine: what one all-reduce costs at 1,024 ranks on 256 workers on 64 hosts, for both
methods, from the cost model (flowreduce.cost, constants measured on this project's machine; the
inter-host link is 10 Gbit/s Ethernet with 4 ms per hop unless a calibrated model is given).

For each algorithm and vector length: the graph's tasks (what the scheduler must handle per call),
the scheduler's share of the call (tasks x the model's per-task cost), and the predicted seconds of
the whole call. method="tasks" plans over the 1,024 ranks (a task per plan node and chunk); method=
"p2p" plans over the 256 workers (each combines its 4 ranks first) and its graph is a hand-in per
worker, a barrier and an output per rank (docs/p2p.md).

    python benchmarks/simulate_scale.py [--ranks 1024 --workers 256 --hosts 64] [--cost-model FILE]
"""

from __future__ import annotations

import argparse
import time

import flowreduce
from flowreduce.cost import CostModel, configured_model

ALGORITHMS = ("butterfly", "tree", "reduce-broadcast", "ring", "hierarchical")
LENGTHS = (1_000, 100_000, 10_000_000)


def groups(ranks: int, hosts: int) -> list[list[int]]:
    per = ranks // hosts
    return [list(range(h * per, (h + 1) * per)) for h in range(hosts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--cost-model", default=None)
    ap.add_argument("--max-nodes", type=int, default=300_000, help="plans with more nodes are not built")
    args = ap.parse_args()
    model: CostModel = CostModel.from_file(args.cost_model) if args.cost_model else configured_model()
    P, W, H = args.ranks, args.workers, args.hosts
    by_rank, by_worker = groups(P, H), groups(W, H)
    print(f"# {P} ranks on {W} workers on {H} hosts; float64; model: per task {model.task * 1e3:.2f} ms, "
          f"per level {model.level * 1e3:.1f} ms, per engine step {model.message * 1e3:.1f} ms, call "
          f"{model.call * 1e3:.0f} ms, inter-host {1 / (model.inter or flowreduce.cost.DEFAULT_INTER).beta / 1e9 * 8:.0f} "
          "Gbit/s")
    print(f"{'algorithm':>17} {'n':>10} {'tasks: tasks':>13} {'sched s':>8} {'call s':>8} {'p2p: tasks':>11} "
          f"{'sched s':>8} {'call s':>8} {'speed-up':>9}")
    for algorithm in ALGORITHMS:
        for n in LENGTHS:
            nbytes = 8 * n
            t0 = time.perf_counter()
            p2p_plan = flowreduce.cost.tune(algorithm, W, nbytes, model=model, hosts=by_worker)
            p2p_tasks = W + 1 + P
            p2p_time = model.p2p_time(p2p_plan, nbytes, P, by_worker)
            cells = []
            if algorithm == "ring" and 2 * P * (P - 1) > args.max_nodes:
                cells = ["not built", "", ""]
                tasks_time = None
            else:
                plan = flowreduce.cost.tune(algorithm, P, nbytes, model=model, hosts=by_rank)
                card = plan.cost(nbytes)
                tasks_time = model.predict(plan, nbytes, by_rank)
                cells = [f"{card.tasks:,}", f"{card.tasks * model.task:.2f}", f"{tasks_time:.2f}"]
            speed = f"{tasks_time / p2p_time:.0f}x" if tasks_time else ""
            print(f"{algorithm:>17} {n:>10,} {cells[0]:>13} {cells[1]:>8} {cells[2]:>8} {p2p_tasks:>11,} "
                  f"{p2p_tasks * model.task:>8.2f} {p2p_time:>8.2f} {speed:>9}  ({time.perf_counter() - t0:.1f} s to plan)",
                  flush=True)


if __name__ == "__main__":
    main()
