"""``flowreduce train``: data-parallel training of a numpy MLP on
scikit-learn's digits, one gradient all-reduce per step through flowreduce.

Example::

    flowreduce train --ranks 4 --algorithm ring --epochs 20
    flowreduce train --ranks 4 --bucket-bytes 16kB --straggler 2:0.05 --trace out/

Prints per epoch the loss and accuracy (training and test set, from rank
0's weights) and the median time per step split into computation and
communication (see :mod:`flowreduce.train.timing`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from flowreduce.algorithms import format_spec
from flowreduce.cli.args import spec_from_arg


def parse_bucket_bytes(text: str) -> int | None:
    if text.lower() in ("none", "off", "0"):
        return 0
    from dask.utils import parse_bytes

    return parse_bytes(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from flowreduce.fusion import DEFAULT_BUCKET_BYTES
    from flowreduce.launch import add_cluster_arguments

    parser.add_argument("--framework", choices=("numpy", "torch"), default="numpy",
                        help="numpy: the MLP study; torch: a CNN trained by flowreduce.torch.Trainer "
                             "(ElasticTrainer with --elastic) "
                             "(needs pip install 'flowreduce[torch]'; uses --ranks, --algorithm, --epochs, "
                             "--batch-size, --lr, --momentum, --seed, --bucket-bytes, --trace, --trace-steps, --json, "
                             "--save, --elastic, --min-ranks, --max-ranks, cluster options)")
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks = workers (default 4)")
    parser.add_argument("--algorithm", default="auto", help="all-reduce algorithm, with options as "
                        "NAME:OPTION=VALUE[:...], e.g. hierarchical:group_size=2 (default: auto)")
    parser.add_argument("--chunks", type=int, default=None, help="all-reduce chunks (default: the cost model's)")
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (default 16; "
                        "the global batch is this times --ranks)")
    parser.add_argument("--hidden", default="128,64", help="hidden layer widths (default 128,64)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--bucket-bytes", type=parse_bucket_bytes, default=DEFAULT_BUCKET_BYTES,
                        help="tensor fusion bucket size, e.g. 25MB (default), 16kB; 0: no fusion")
    parser.add_argument("--no-overlap", action="store_true",
                        help="all-reduce the whole gradient after the backward pass (no bucket overlap)")
    parser.add_argument("--straggler", default=None, metavar="RANK:SECONDS",
                        help="delay RANK's backward pass by SECONDS every step")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="trace some steps of the first epoch and write trace.json, trace.csv, "
                             "steps.png/svg and timeline.png/svg into DIR")
    parser.add_argument("--trace-steps", type=int, default=3, help="steps to trace (default 3, after 2 warm-up steps)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write per-epoch metrics and step timings")
    parser.add_argument("--save", default=None, metavar="FILE",
                        help="torch: save the trained model and optimizer (state_dict, torch.save) to FILE")
    parser.add_argument("--steps-per-task", type=int, default=None, metavar="K",
                        help="torch: run K optimizer steps in one task per rank, the ranks averaging gradients "
                             "with an SPMD communicator between them (one host, shared-memory step; "
                             "default: 10 where steps can be fused; 1: every step a task of its own)")
    parser.add_argument("--elastic", action="store_true",
                        help="keep training when workers leave (the survivors re-shard the data and re-run the "
                             "interrupted step) and grow when workers join (they get rank 0's weights and "
                             "momentum); with --framework numpy or torch; see docs/training.md")
    parser.add_argument("--max-ranks", type=int, default=None,
                        help="with --elastic: never grow past this many ranks (default: every worker that joins)")
    parser.add_argument("--min-ranks", type=int, default=1,
                        help="with --elastic: stop with an error when fewer ranks are left (default 1)")
    add_cluster_arguments(parser, workers_default=None)


def config_from_args(args: argparse.Namespace) -> Any:
    from flowreduce.train.config import TrainConfig, parse_straggler

    algorithm, options = spec_from_arg(args.algorithm)
    hidden = tuple(int(h) for h in str(args.hidden).split(",") if h.strip())
    return TrainConfig(ranks=args.ranks, hidden=hidden, batch=args.batch_size, lr=args.lr, momentum=args.momentum,
                       epochs=args.epochs, seed=args.seed, dtype=args.dtype, algorithm=algorithm, options=options,
                       chunks=args.chunks, bucket_bytes=args.bucket_bytes, overlap=not args.no_overlap,
                       straggler=parse_straggler(args.straggler))


def run(args: argparse.Namespace) -> int:
    if args.framework != "torch" and args.save:
        raise SystemExit("--save saves a torch model: it needs --framework torch")
    if args.framework == "torch":
        from flowreduce.cli.train_torch import run as run_torch

        return run_torch(args)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from flowreduce.launch import from_args, ranked_workers
    from flowreduce.train import timing
    from flowreduce.train.loop import DataParallel

    config = config_from_args(args)
    console = Console()
    with from_args(args, workers=config.ranks) as client:
        workers = ranked_workers(client)
        if len(workers) < config.ranks:
            raise SystemExit(f"--ranks {config.ranks} needs {config.ranks} workers, the cluster has {len(workers)}")
        if args.elastic:
            return _run_elastic(args, client, config, workers[:config.ranks], console)
        dp = DataParallel(client, config, workers[:config.ranks])
        console.print(f"training MLP 64-{'-'.join(map(str, config.hidden))}-10 on digits: {config.ranks} ranks x "
                      f"{config.batch} samples/step, {dp.steps_per_epoch} steps/epoch, algorithm {format_spec(config.algorithm, config.options)}, "
                      f"bucket {config.bucket_bytes or 0} B, overlap {'on' if config.overlap else 'off'}"
                      + (f", straggler rank {config.straggler[0]} +{config.straggler[1] * 1e3:g} ms"
                         if config.straggler else ""), soft_wrap=True)
        report: dict[str, Any] = {"config": {k: getattr(config, k) for k in config.__dataclass_fields__},
                                  "epochs": []}
        all_timings: list[timing.StepTiming] = []
        tracer = _TraceWindow(client, dp, args.trace, args.trace_steps) if args.trace else None
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("epoch 1", total=config.epochs * dp.steps_per_epoch)
            for epoch in range(config.epochs):
                bar.update(task, description=f"epoch {epoch + 1}/{config.epochs}")
                since = time.time() - 1.0
                steps = []
                for i in range(dp.steps_per_epoch):
                    if tracer is not None:
                        tracer.before(len(dp.steps))
                    steps.append(dp.step(epoch, i))
                    if tracer is not None:
                        tracer.after(len(dp.steps))
                    bar.advance(task)
                dp.finish()
                metrics = dp.evaluate()
                ts = timing.read(client, dp, steps, since)
                warm = ts[2:] if epoch == 0 and len(ts) > 4 else ts  # the first steps start the pipeline
                all_timings += warm
                m = timing.medians(warm)
                bar.console.print(
                    f"epoch {epoch + 1:3d}  loss {metrics['train_loss']:.4f}  train acc {metrics['train_acc']:.2%}  "
                    f"test acc {metrics['test_acc']:.2%}  step {m.seconds * 1e3:6.1f} ms = compute "
                    f"{m.compute * 1e3:5.1f} + comm {m.comm * 1e3:5.1f} ms ({m.comm_share:.0%} comm)", soft_wrap=True)
                report["epochs"].append({"epoch": epoch + 1, **metrics, "median": m.as_dict(),
                                         "steps": [t.as_dict() for t in ts]})
        m = timing.medians(all_timings)
        console.print(f"final test accuracy {metrics['test_acc']:.2%}; median step {m.seconds * 1e3:.1f} ms "
                      f"(compute {m.compute * 1e3:.1f} ms, comm {m.comm * 1e3:.1f} ms, all-reduce tasks "
                      f"{m.allreduce_work * 1e3:.1f} ms) over {m.steps} steps", soft_wrap=True)
        report["final"] = {"test_acc": metrics["test_acc"], "median": m.as_dict()}
        if tracer is not None:
            for path in tracer.write():
                console.print(f"wrote {path}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    return 0


def _run_elastic(args: argparse.Namespace, client: Any, config: Any, workers: list[str], console: Any) -> int:
    """``--elastic``: every step committed, losses and joins handled at step
    boundaries; prints the rank set's changes and each epoch's metrics."""
    from statistics import median

    from flowreduce.train.loop import ElasticDataParallel

    if args.trace:
        raise SystemExit("--trace is not supported with --elastic")
    dp = ElasticDataParallel(client, config, workers, max_ranks=args.max_ranks, min_ranks=args.min_ranks)
    console.print(f"elastic training MLP 64-{'-'.join(map(str, config.hidden))}-10 on digits: {len(workers)} ranks "
                  f"(at most {args.max_ranks or 'any'}, at least {args.min_ranks}) x {config.batch} samples/step, "
                  f"algorithm {format_spec(config.algorithm, config.options)}", soft_wrap=True)
    report: dict[str, Any] = {"config": {k: getattr(config, k) for k in config.__dataclass_fields__}, "epochs": [],
                              "changes": []}
    seen = {"epoch": 0, "changes": 0, "from": 0}

    def on_step(_rec: Any) -> None:
        for step, change in dp.membership.history[seen["changes"]:]:
            console.print(f"step {step}: {change}", soft_wrap=True)
            report["changes"].append({"step": step, "before": list(change.before), "after": list(change.after)})
        seen["changes"] = len(dp.membership.history)
        if dp.epoch != seen["epoch"] or dp.finished():
            metrics = dp.evaluate()
            steps = [s for s in dp.steps[seen["from"]:] if not s.failed and s.done]
            ms = median(s.done - s.submitted for s in steps) * 1e3 if steps else float("nan")
            console.print(f"epoch {seen['epoch'] + 1:3d}  loss {metrics['train_loss']:.4f}  train acc "
                          f"{metrics['train_acc']:.2%}  test acc {metrics['test_acc']:.2%}  {len(dp.workers)} ranks  "
                          f"step {ms:6.1f} ms  ({sum(s.failed for s in dp.steps[seen['from']:])} re-run)",
                          soft_wrap=True)
            report["epochs"].append({"epoch": seen["epoch"] + 1, **metrics, "ranks": len(dp.workers),
                                     "median_step_ms": ms})
            seen["epoch"], seen["from"] = dp.epoch, len(dp.steps)

    dp.train(on_step)
    final = report["epochs"][-1] if report["epochs"] else dp.evaluate()
    console.print(f"final test accuracy {final['test_acc']:.2%} on {len(dp.workers)} ranks; "
                  f"{sum(s.failed for s in dp.steps)} step(s) re-run after a lost worker", soft_wrap=True)
    report["final"] = {"test_acc": final["test_acc"], "ranks": len(dp.workers)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


class _TraceWindow:
    """Trace steps ``[2, 2 + count)`` of the run (after two warm-up steps)."""

    def __init__(self, client: Any, trainer: Any, out_dir: str, count: int, first: int = 2) -> None:
        self.client, self.trainer, self.out_dir = client, trainer, out_dir
        self.first, self.last = first, first + max(1, count)
        self.trace: Any = None

    def before(self, n: int) -> None:
        if n == self.first and self.trace is None:
            import flowreduce

            self.trainer.finish()  # start from a drained pipeline, so the window holds whole steps
            self.trace = flowreduce.trace(self.client, flush_every=0).start()

    def after(self, n: int) -> None:
        if n == self.last and self.trace is not None and self.trace.end is None:
            self.trainer.finish()
            self.trace.stop()

    def write(self) -> list[str]:
        if self.trace is None:
            return []
        if self.trace.end is None:
            self.trace.stop()
        from flowreduce.tracing.export import to_chrome, to_csv

        os.makedirs(self.out_dir, exist_ok=True)
        paths = [to_chrome(self.trace, os.path.join(self.out_dir, "trace.json")),
                 to_csv(self.trace, os.path.join(self.out_dir, "trace.csv"))]
        steps_path = os.path.join(self.out_dir, "steps.json")  # which all-reduce calls belong to which step
        with open(steps_path, "w") as f:
            json.dump({"token": self.trainer.token, "workers": list(self.trainer.workers),
                       "steps": [{"step": s.step, "tokens": list(s.tokens)} for s in self.trainer.steps
                                 if self.first <= s.step < self.last]}, f, indent=1)
        paths.append(steps_path)
        try:
            from flowreduce.tracing.plot import plot_timeline
            from flowreduce.train.plot import plot_steps

            c = self.trainer.config
            title = (f"{c.ranks} ranks, {format_spec(c.algorithm, c.options)}, bucket {c.bucket_bytes or 0} B, overlap "
                     f"{'on' if c.overlap else 'off'}" + (f", straggler {c.straggler}" if c.straggler else ""))
            steps = [os.path.join(self.out_dir, f"steps.{ext}") for ext in ("png", "svg")]
            plot_steps(self.trace, self.trainer.workers, steps, title=title)
            timeline = [os.path.join(self.out_dir, f"timeline.{ext}") for ext in ("png", "svg")]
            plot_timeline(self.trace, timeline, title=title)
            paths += steps + timeline
        except ImportError as e:
            print(f"no pictures: {e}")
        return [str(p) for p in paths]
