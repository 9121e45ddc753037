"""``flowreduce train --framework torch``: the digits CNN
(:mod:`flowreduce.torch.digits`) trained by :class:`flowreduce.torch.Trainer`.

Prints per epoch the loss and accuracy (from rank 0's model) and the median
step time split into computation and communication; ``--save`` writes the
trained model and optimizer (:meth:`flowreduce.torch.Trainer.save`).
``--elastic``: :class:`flowreduce.torch.ElasticTrainer` instead, which goes
on when workers leave and grows when they join; it prints the rank set's
changes and per epoch the metrics, the ranks and the median step time."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from flowreduce.algorithms import format_spec
    from flowreduce.cli.bench import spec_from_arg
    from flowreduce.launch import from_args, ranked_workers
    from flowreduce.torch import Trainer, digits

    if args.elastic and args.trace:  # before a cluster is started
        raise SystemExit("--trace is not supported with --elastic")
    algorithm, options = spec_from_arg(args.algorithm)
    console = Console()
    with from_args(args, workers=args.ranks) as client:
        workers = ranked_workers(client)
        if len(workers) < args.ranks:
            raise SystemExit(f"--ranks {args.ranks} needs {args.ranks} workers, the cluster has {len(workers)}")
        if args.elastic:
            return _run_elastic(args, client, workers[:args.ranks], algorithm, options, console)
        steps = digits.steps_per_epoch(args.ranks, args.batch_size, args.seed)
        with Trainer(client, model=digits.DigitsCNN, optimizer=digits.SGD(args.lr, args.momentum),
                     loss=torch.nn.functional.cross_entropy, data=digits.Shards(args.batch_size, args.seed),
                     workers=workers[:args.ranks], algorithm=algorithm, bucket_bytes=args.bucket_bytes,
                     seed=args.seed, threads=1, options=options, steps_per_task=args.steps_per_task) as trainer:
            fused = trainer.step_graph["steps_per_task"]
            console.print(f"training CNN on digits with flowreduce.torch: {args.ranks} ranks x {args.batch_size} "
                          f"samples/step, {steps} steps/epoch, algorithm {format_spec(algorithm, options)}, "
                          f"bucket {args.bucket_bytes or 0} B" + (f", {fused} steps per task" if fused > 1 else ""),
                          soft_wrap=True)
            report: dict[str, Any] = {"framework": "torch", "epochs": []}
            for epoch in range(args.epochs):
                if epoch == 0 and args.trace:
                    ts = _traced_epoch(client, trainer, steps, args, console)
                else:
                    ts = trainer.train(steps, progress=True)
                warm = ts[2:] if epoch == 0 and len(ts) > 4 else ts
                m = {k: statistics.median(getattr(t, k) for t in warm) for k in ("seconds", "compute", "comm")}
                metrics = trainer.evaluate(digits.Accuracy(args.seed))
                console.print(f"epoch {epoch + 1:3d}  loss {metrics['train_loss']:.4f}  train acc "
                              f"{metrics['train_acc']:.2%}  test acc {metrics['test_acc']:.2%}  step "
                              f"{m['seconds'] * 1e3:6.1f} ms = compute {m['compute'] * 1e3:5.1f} + comm "
                              f"{m['comm'] * 1e3:5.1f} ms", soft_wrap=True)
                report["epochs"].append({"epoch": epoch + 1, **metrics, "median": m})
            console.print(f"final test accuracy {metrics['test_acc']:.2%}")
            report["final"] = {"test_acc": metrics["test_acc"], "steps": len(trainer.steps)}
            if args.save:  # a path on rank 0's worker: the embedded cluster's is this machine
                console.print(f"saved {trainer.save(os.path.abspath(args.save))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _run_elastic(args: argparse.Namespace, client: Any, workers: list[str], algorithm: str, options: dict,
                 console: Any) -> int:
    """``--elastic``: every step committed, losses and joins handled at step boundaries."""
    import torch

    from flowreduce.algorithms import format_spec
    from flowreduce.torch import ElasticTrainer, digits

    report: dict[str, Any] = {"framework": "torch", "elastic": True, "epochs": [], "changes": []}
    with ElasticTrainer(client, model=digits.DigitsCNN, optimizer=digits.SGD(args.lr, args.momentum),
                        loss=torch.nn.functional.cross_entropy, data=digits.ElasticShards(args.batch_size, args.seed),
                        epochs=args.epochs, workers=workers, max_ranks=args.max_ranks, min_ranks=args.min_ranks,
                        algorithm=algorithm, bucket_bytes=args.bucket_bytes, seed=args.seed, threads=1,
                        options=options) as trainer:
        console.print(f"elastic training CNN on digits with flowreduce.torch: {len(workers)} ranks (at most "
                      f"{args.max_ranks or 'any'}, at least {args.min_ranks}) x {args.batch_size} samples/step, "
                      f"algorithm {format_spec(algorithm, options)}, bucket {args.bucket_bytes or 0} B", soft_wrap=True)
        seen = {"epoch": 0, "changes": 0, "from": 0}

        def on_step(_rec: Any) -> None:
            for step, change in trainer.membership.history[seen["changes"]:]:
                console.print(f"step {step}: {change}", soft_wrap=True)
                report["changes"].append({"step": step, "before": list(change.before), "after": list(change.after)})
            seen["changes"] = len(trainer.membership.history)
            if trainer.epoch != seen["epoch"] or trainer.finished():
                metrics = trainer.evaluate(digits.Accuracy(args.seed))
                steps = trainer.steps[seen["from"]:]
                done = [s.seconds for s in steps if not s.failed]
                ms = statistics.median(done) * 1e3 if done else float("nan")
                console.print(f"epoch {seen['epoch'] + 1:3d}  loss {metrics['train_loss']:.4f}  train acc "
                              f"{metrics['train_acc']:.2%}  test acc {metrics['test_acc']:.2%}  "
                              f"{len(trainer.workers or ())} ranks  step {ms:6.1f} ms  "
                              f"({sum(s.failed for s in steps)} re-run)", soft_wrap=True)
                report["epochs"].append({"epoch": seen["epoch"] + 1, **metrics, "ranks": len(trainer.workers or ()),
                                         "median_step_ms": ms})
                seen["epoch"], seen["from"] = trainer.epoch, len(trainer.steps)

        trainer.train(on_step)
        final = report["epochs"][-1] if report["epochs"] else trainer.evaluate(digits.Accuracy(args.seed))
        console.print(f"final test accuracy {final['test_acc']:.2%} on {len(trainer.workers or ())} ranks; "
                      f"{sum(s.failed for s in trainer.steps)} step(s) re-run after a lost worker", soft_wrap=True)
        report["final"] = {"test_acc": final["test_acc"], "ranks": len(trainer.workers or ()),
                           "steps": trainer.committed_steps}
        if args.save:  # a path on rank 0's worker: the embedded cluster's is this machine
            console.print(f"saved {trainer.save(os.path.abspath(args.save))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def _traced_epoch(client: Any, trainer: Any, steps: int, args: argparse.Namespace, console: Any) -> list:
    """The first epoch with steps ``[2, 2 + --trace-steps)`` traced (after two
    warm-up steps): ``trace.json`` (Perfetto) and ``steps.png/svg`` (one lane
    per rank: backward, update and each bucket's all-reduce) in ``--trace``."""

    import flowreduce
    from flowreduce.tracing.export import to_chrome

    first = min(2, steps)
    count = max(0, min(args.trace_steps, steps - first))
    ts = trainer.train(first)
    with flowreduce.trace(client) as tr:
        ts += trainer.train(count, steps_per_task=1)  # a task per step, so the trace shows each one
    ts += trainer.train(steps - first - count)
    os.makedirs(args.trace, exist_ok=True)
    written = [to_chrome(tr, os.path.join(args.trace, "trace.json"))]
    try:
        from flowreduce.train.plot import plot_steps

        pictures = [os.path.join(args.trace, f"steps.{ext}") for ext in ("png", "svg")]
        plot_steps(tr, trainer.workers, pictures,
                   title=f"flowreduce.torch, digits CNN, {trainer.ranks} ranks, {count} steps")
        written += pictures
    except ImportError as e:
        console.print(f"no pictures: {e}")
    for path in written:
        console.print(f"wrote {path}")
    return ts
