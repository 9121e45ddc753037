"""What SPMD jobs did: one event per collective and rank, read from the workers.

Every collective adds one record to its worker's log (``Mailbox.log``, a
bounded ring: :mod:`flowreduce.schedule.spmd_log`), read back as
:class:`~flowreduce.spmd.comm.Event` objects (``comm.events``, and here);
:func:`collect` reads the workers' logs (one ``client.run``, after the fact:
nothing is sent while a job runs) as rows ready for a table, a CSV or a
timeline: the collective (the phase), the rank and its worker, start and
stop (``time.time()`` of the worker), the bytes of its input and of what
it sent and received between hosts, its peers and the path it took.
"""

from __future__ import annotations

from typing import Any

from flowreduce.schedule.spmd_mailbox import mailbox_of


def _read(run: str | None = None, dask_worker: Any = None) -> list[dict[str, Any]]:
    box = mailbox_of(dask_worker)
    if box is None:
        return []
    def wanted(job: str, rank: int) -> bool:
        return run is None or job == run or job.startswith(f"{run}/") or job.startswith(f"{run}.")

    return [{"job": job, "rank": rank, "worker": dask_worker.address, "phase": e.collective, **e._asdict()}
            for job, rank, e in box.log.entries(wanted)]


def collect(client: Any, job: str | None = None) -> list[dict[str, Any]]:
    """Every logged collective (of ``job``, a job token or ``<token>.<attempt>``, if given), by start time.

    Each row: ``job`` (``<token>.<attempt>``, ``/<subgroup>`` for a subgroup's), ``rank``,
    ``worker``, ``phase`` (the collective), ``seq``, ``start``, ``stop``, ``nbytes``, ``sent``,
    ``received``, ``peers``, ``path`` (``local``, ``shm``, ``dask``, ``shm+dask``), ``algorithm``.
    """
    rows = [row for got in client.run(_read, job).values() for row in got]
    return sorted(rows, key=lambda r: (r["start"], r["rank"]))
