"""The link between hosts as a communicator finds it: measured once, priced by the cost model.

``algorithm="auto"`` between hosts prices each plan on the inter-host link
of the cost model (:attr:`flowreduce.cost.CostModel.inter`). Unless a
calibrated model names that link (``flowreduce.cost-model``), the default is
10 Gbit/s with 4 ms a hop, and on a slower network ``auto`` then sends
whole vectors where a bandwidth-optimal plan would halve the bytes
(recursive doubling of radix 4 at 800 kB between 4 hosts on 1 Gbit/s:
3.2x gloo's time, where butterfly of radix 4 took 1.8x).

So the first all-reduce with ``algorithm="auto"`` between hosts measures
the link, over the very mailboxes the collectives use and where their steps
run (the worker's event loop: the probe is a walk, as a plan is, timed there),
and every rank prices its plans with that::

    leaders 0..3: ROUNDS x (a token to every other of them, then every other's)
                        alpha = the median round on leader 0: a dependent step of a plan
                        with all its messages (the event loops, the hand-overs, the kernel)
    leader 0 -> 1: PINGS x (8 B, echoed)          rtt = the least round trip
                   BIGS x (PROBE_BYTES, acked)    big = the least round trip
                        beta = (big - rtt) / PROBE_BYTES: the link's seconds per byte
    leader 0 -> every other leader: (alpha, beta); each leader -> its host group (shared memory)

Leader 0 alone decides, so every rank prices with the same numbers and
picks the same plan. It costs the first such collective ROUNDS steps,
``PINGS + BIGS`` round trips and ``BIGS * PROBE_BYTES`` on one link (about
50 ms on 1 Gbit/s).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from flowreduce.cost import Link

#: All-to-all rounds of tokens timed (the first, which also opens the connections, is not counted).
ROUNDS = 6
#: The leaders that take part in the rounds (a step of radix 4: three messages out, three in, on each).
ROUND_LEADERS = 4
#: Small round trips timed between leaders 0 and 1 (the least is kept).
PINGS = 3
#: Bytes of each timed transfer, and how many (the least is kept). Larger than a
#: token-bucket shaper's burst, small enough to cost ~17 ms each on 1 Gbit/s.
PROBE_BYTES, BIGS = 2 << 20, 2
#: The fastest link believed (bytes/s): a probe too noisy to see the bytes' time gets this.
FASTEST = 100e9

Send = Callable[[int, str, Any], None]  # (leader index, key, value)


def fit(step: float, rtt: float, big: float, nbytes: float = PROBE_BYTES) -> Link:
    """The link of a dependent step of ``step`` seconds, a small round trip of ``rtt`` seconds and one
    of ``big`` seconds carrying ``nbytes`` out (and a small answer back): α = step, β = (big - rtt) /
    nbytes, at least 1 / :data:`FASTEST`."""
    return Link(alpha=max(step, 0.0), beta=max((big - rtt) / nbytes, 1.0 / FASTEST))


def measure(me: int, leaders: int, send: Send,
            clock: Callable[[], float] = time.perf_counter) -> Generator[tuple[int, str], Any, Link | None]:
    """Leader ``me`` of ``leaders`` (at least 2) takes part; leader 0's walk returns the link, the others'
    None. A walk (:func:`flowreduce.spmd.planrun.walk`): it yields the (leader, key) of each token it
    waits for and is sent it, so it runs where a plan's steps run (the worker's event loop) and times
    them as they run there."""
    token = np.zeros(1)
    others = [i for i in range(min(leaders, ROUND_LEADERS)) if i != me] if me < ROUND_LEADERS else []
    rounds = []
    for k in range(ROUNDS if others else 0):
        t = clock()
        for i in others:
            send(i, f"r{k}", token)
        for i in others:
            yield i, f"r{k}"
        rounds.append(clock() - t)
    if me == 1:
        for k in range(PINGS):
            yield 0, f"p{k}"
            send(0, f"q{k}", token)
        for k in range(BIGS):
            yield 0, f"P{k}"
            send(0, f"Q{k}", token)
    if me != 0:
        return None
    small, big = [], []
    for k in range(PINGS):
        t = clock()
        send(1, f"p{k}", token)
        yield 1, f"q{k}"
        small.append(clock() - t)
    payload = np.zeros(PROBE_BYTES // 8)
    for k in range(BIGS):
        t = clock()
        send(1, f"P{k}", payload)
        yield 1, f"Q{k}"
        big.append(clock() - t)
    return fit(statistics.median(rounds[1:]), min(small), min(big))


def as_array(link: Link) -> np.ndarray:
    """``link`` as what leader 0 sends (and a host group broadcasts)."""
    return np.array([link.alpha, link.beta])


def from_array(a: Any) -> Link:
    a = np.asarray(a, dtype=np.float64)
    return Link(alpha=float(a[0]), beta=float(a[1]))
