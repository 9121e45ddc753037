"""How backward, fusion, all-reduce and update interleave, in numbers, from
a trace written by ``flowreduce train --trace DIR``.

Per traced step and rank (times in ms from the step's first forward task):
when the backward pass ran, when the step's all-reduce tasks (fusion,
split, reduce, copy) ran, how much of the all-reduce's span lies inside the
backward span (overlap), and when the update started.

    python benchmarks/train/interleave.py DIR
"""

from __future__ import annotations

import ast
import csv
import json
import sys


def analyse(out_dir: str) -> list[dict]:
    meta = json.load(open(f"{out_dir}/steps.json"))
    token = meta["token"]
    step_of = {t: s["step"] for s in meta["steps"] for t in s["tokens"]}
    rows = [r for r in csv.DictReader(open(f"{out_dir}/trace.csv"))
            if r["phase"] in ("user-compute", "fusion", "split", "reduce", "copy")]
    spans: dict[tuple[int, int, str], list[float]] = {}
    for r in rows:
        key = ast.literal_eval(r["key"])
        start, stop = float(r["start"]), float(r["stop"])
        if r["phase"] == "user-compute":
            if not (isinstance(key, tuple) and key[0].endswith(token)):
                continue
            kind = key[0][len("train-"):-len(token) - 1]
            kind = "backward" if kind in ("grad", "delta", "gather") else kind
            step, rank = key[1], key[2]
        else:
            if r["token"] not in step_of or r["rank"] == "":
                continue
            kind, step, rank = "allreduce", step_of[r["token"]], int(r["rank"])
        s = spans.setdefault((step, rank, kind), [start, stop])
        s[0], s[1] = min(s[0], start), max(s[1], stop)
    out = []
    for step in sorted({k[0] for k in spans if k[0] in set(step_of.values())}):
        t0 = min(v[0] for k, v in spans.items() if k[0] == step and k[2] == "forward")
        for rank in sorted({k[1] for k in spans if k[0] == step}):
            b = spans.get((step, rank, "backward"))
            a = spans.get((step, rank, "allreduce"))
            u = spans.get((step, rank, "update"))
            if not (b and a and u):
                continue
            inside = max(0.0, min(b[1], a[1]) - max(b[0], a[0]))
            out.append({"step": step, "rank": rank,
                        "backward": ((b[0] - t0) * 1e3, (b[1] - t0) * 1e3),
                        "allreduce": ((a[0] - t0) * 1e3, (a[1] - t0) * 1e3),
                        "overlap_ms": inside * 1e3, "update_start": (u[0] - t0) * 1e3})
    return out


def main(argv: list[str]) -> int:
    rows = analyse(argv[1])
    print("| step | rank | backward (ms) | all-reduce tasks (ms) | overlap (ms) | update starts (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b, a = r["backward"], r["allreduce"]
        print(f"| {r['step']} | {r['rank']} | {b[0]:.0f}–{b[1]:.0f} | {a[0]:.0f}–{a[1]:.0f} | "
              f"{r['overlap_ms']:.0f} | {r['update_start']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
