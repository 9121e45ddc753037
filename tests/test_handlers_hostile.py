"""Handlers trust nobody: malformed and hostile arguments sent through the
real comm to every handler flowreduce adds (the scheduler's
``flowreduce_states``, its stream handlers ``flowreduce-watch`` and
``flowreduce-dashboard-publish``, the workers' ``flowreduce_reduce_held``)
and to the shared-memory pool through names a peer hands over (a handle in
a task's data, a post's link): each is refused with an error logged on
``flowreduce`` naming the handler, nothing is written outside the pool, and
the cluster still gives numpy's answer afterwards (docs/shared-memory.md,
"What the handlers accept")."""

from __future__ import annotations

import logging
import os
import pickle
import uuid

import dask
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster
from utils import wait_until, workers_of

import flowreduce
from flowreduce.dashboard.store import OP as PUBLISH
from flowreduce.dashboard.store import store_of
from flowreduce.kernels.shm import Handle, received
from flowreduce.ops import resolve_op
from flowreduce.schedule.guard import STATES, guard_of
from flowreduce.schedule.peer_reads import HANDLER, MAX_HELD_KEYS, named_op
from flowreduce.shm import pool as shm_pool
from flowreduce.shm import posts as shm_posts

N = 1000


@pytest.fixture(scope="module")
def cluster(shm_dir):
    with dask.config.set({"flowreduce.shm.directory": shm_dir}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        allreduced(client)  # installs every handler and plugin
        client.run(_listen)
        client.run_on_scheduler(_listen)
        yield client


@pytest.fixture
def client(cluster, shm_dir, tmp_path):
    """The cluster, checked after each test: it still reduces right, and
    nothing hostile was created (outside the pool or in it)."""
    outside = set(os.listdir("/dev/shm"))
    yield cluster
    allreduced(cluster)
    assert not [p for p in (tmp_path / "pwned", EVIL) if os.path.lexists(p)]
    assert not [n for n in set(os.listdir("/dev/shm")) - outside if "evil" in n or "pwned" in n]
    assert all(n.startswith(shm_pool.PREFIX) for n in os.listdir(shm_dir)), os.listdir(shm_dir)


#: Where a path traversal from the pool's directory (/dev/shm/<dir>/../../tmp/...) would land.
EVIL = f"/tmp/flowreduce-evil-{uuid.uuid4().hex[:8]}"


def stable_id(value) -> str:
    """A test id without EVIL's random part or an object's address: pytest-xdist's processes each collect
    the tests and must name them alike."""
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return repr(value).replace(os.path.basename(EVIL), "flowreduce-evil")


TRAVERSALS = [f"../../tmp/{os.path.basename(EVIL)}", EVIL, "flowreduce-shm-1-2-3/../../../tmp/evil",
              "flowreduce-shm-1-2-3\x00evil", "..", "", None, ["flowreduce-shm-1-2-3"], {"name": "x"}]


def allreduced(client, algorithm: str = "direct") -> None:
    ws = workers_of(client)
    xs = [np.arange(N, dtype=np.float64) * (r + 1) for r in range(4)]
    futures = [client.scatter(x, workers=[ws[r % len(ws)]], hash=False) for r, x in enumerate(xs)]
    out = flowreduce.allreduce(client, futures, algorithm=algorithm)
    np.testing.assert_array_equal(client.gather(out)[3], np.sum(xs, axis=0))


# -- the refusals, as logged where they happen ----------------------------------------------------------

class _Heard(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _listen(dask_worker=None, dask_scheduler=None) -> None:
    log = logging.getLogger("flowreduce")
    if not any(isinstance(h, _Heard) for h in log.handlers):
        log.addHandler(_Heard())


def _heard(dask_worker=None, dask_scheduler=None) -> list[str]:
    return next(h for h in logging.getLogger("flowreduce").handlers if isinstance(h, _Heard)).messages


def heard(client, where: str, count: int) -> list[str]:
    """The error messages logged at ``where`` ("scheduler", or a worker's
    address) since its start, once there are at least ``count`` (bounded wait)."""
    def got() -> list[str]:
        return client.run_on_scheduler(_heard) if where == "scheduler" else client.run(_heard, workers=[where])[where]
    wait_until(lambda: len(got()) >= count, 10, step=0.05)
    return got()


def refused_at(client, where: str, handler: str, send) -> list[str]:
    """Run ``send()`` and return the refusals of ``handler`` it made ``where`` log (at least one)."""
    before = len(heard(client, where, 0))
    reply = send()
    new = [m for m in heard(client, where, before + 1)[before:] if handler in m and "refused" in m]
    assert new, f"{handler} logged no refusal for this request (reply {reply!r})"
    return new


# -- the scheduler --------------------------------------------------------------------------------------

def states(client, **kwargs):
    return client.sync(getattr(client.scheduler, STATES), **kwargs)


@pytest.mark.parametrize("keys", [None, "a-key", {"k": 1}, [[{"k": 1}]], [{"k": 1}], 7],
                         ids=["none", "string", "dict", "tuple-of-dict-key", "dict-key", "int"])
def test_states_refuses_what_is_not_a_list_of_keys(client, keys):
    def send():
        reply = states(client, keys=keys)
        assert reply["status"] == "error" and reply["message"]
        return reply

    refused_at(client, "scheduler", STATES, send)


def test_states_refuses_more_keys_than_tasks_and_unknown_arguments(client):
    refused_at(client, "scheduler", STATES, lambda: states(client, keys=[f"k{i}" for i in range(100_000)]))
    refused_at(client, "scheduler", STATES, lambda: states(client, keys=[], evil=1))
    x = client.scatter(np.ones(3))
    assert states(client, keys=[x.key])[0][0] == "memory"  # a request flowreduce sends is answered
    # inputs just submitted may not have reached the scheduler (another comm): more than its tasks, answered
    assert states(client, keys=[f"on-its-way-{i}" for i in range(1000)]) is None  # unknown: not refused


def _watches(dask_scheduler=None) -> list[str]:
    return list(guard_of(dask_scheduler).watches)


def _watch(client, **fields) -> None:
    client._send_to_scheduler({"op": "flowreduce-watch", **fields})


REAL = object()  # stands for the token or keys of a call the scheduler has (done: no longer watched)


@pytest.mark.parametrize("fields,why", [
    ({"token": "deadbeef", "outputs": [("flowreduce-ring-output-deadbeef", 0)]}, "unknown call"),
    ({"token": "../../etc"}, "token"),
    ({"token": None}, "token"),
    ({"token": ["a"]}, "token"),
    ({"outputs": None}, "outputs"),
    ({"outputs": {"k": 1}}, "outputs"),
    ({"outputs": [("not-ours", 0)]}, "flowreduce keys"),
    ({"outputs": [{"k": 1}]}, "Dask keys"),
    ({"inputs": {"k": 1}}, "inputs"),
    ({"inputs": [[{"k": 1}]]}, "Dask keys"),
    ({"inputs": [["a"], ["b"], ["c"]]}, "inputs"),
    ({"inputs": [["x"] * 100_000]}, "inputs"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": "soon"}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"hold": "yes"}, "hold"),
    ({"evil": 1}, "unknown arguments"),
], ids=["unknown-token", "traversal-token", "none-token", "list-token", "none-outputs", "dict-outputs",
        "foreign-key", "dict-key", "dict-inputs", "dict-input-key", "more-ranks-than-outputs", "more-keys-than-tasks",
        "negative-timeout",
        "nan-timeout", "string-timeout", "bool-timeout", "string-hold", "unknown-field"])
def test_watch_refuses_malformed_and_unknown_calls(client, fields, why):
    """Each message is a done call's watch with one thing wrong (accepted, it
    would do nothing visible: only the logged refusal says it was checked). A
    stream handler that raised would drop the client's connection: refused
    instead, and the stream goes on."""
    ws = workers_of(client)
    out = flowreduce.allreduce(client, [client.submit(np.ones, N, workers=[w]) for w in ws], algorithm="butterfly")
    client.gather(out)
    token = flowreduce.describe(out).token
    assert wait_until(lambda: token not in client.run_on_scheduler(_watches), 10)
    msg = {"token": token, "outputs": [f.key for f in out], "inputs": [], "timeout": None, "hold": False, **fields}
    refusals = refused_at(client, "scheduler", "flowreduce-watch", lambda: _watch(client, **msg))
    assert why in refusals[0], refusals
    assert client.submit(int, 3, pure=False).result() == 3  # the client's stream still works


def test_watch_of_a_call_watched_already_is_refused(client):
    ws = workers_of(client)
    xs = [client.submit(np.ones, N, workers=[w]) for w in ws]
    client.gather(xs)
    release = Event(f"hostile-{uuid.uuid4().hex}")
    block = client.submit(release.wait, 30, pure=False, workers=[ws[0]])  # the call waits for ws[0]'s thread
    try:
        out = flowreduce.allreduce(client, xs, algorithm="ring")
        token = flowreduce.describe(out).token
        assert wait_until(lambda: token in client.run_on_scheduler(_watches), 10)
        # a second watch of the same call with a timeout would fail it: refused
        refusals = refused_at(client, "scheduler", "flowreduce-watch", lambda: _watch(
            client, token=token, outputs=[f.key for f in out], inputs=[], timeout=0.01, hold=False))
        assert "watched already" in refusals[0]
        assert not out[0].done()
    finally:
        release.set()
    np.testing.assert_array_equal(client.gather(out)[1], np.full(N, 2.0))
    assert block.result()


def _malformed(dask_scheduler=None) -> int:
    return store_of(dask_scheduler).malformed


def _unknown(dask_scheduler=None) -> int:
    return store_of(dask_scheduler).unknown


def test_a_record_of_a_call_not_on_the_page_is_counted_not_logged(client):
    """A call older than the page's history (or never filed) is not malformed: counted apart, logged at
    debug only (a loop of many calls logged thousands of error lines)."""
    out = flowreduce.allreduce(client, [client.submit(np.ones, N, workers=[w]) for w in workers_of(client)])
    client.gather(out)  # the dashboard is installed
    before = client.run_on_scheduler(_unknown), client.run_on_scheduler(_malformed)
    client._send_to_scheduler({"op": PUBLISH, "record": {"token": "deadbeef", "algorithm": "ring", "ranks": 2,
                                                         "nbytes": 8, "chunks": 1}})
    # at least: a late report of an earlier call gone from the page counts there too (its own test's concern)
    assert wait_until(lambda: client.run_on_scheduler(_unknown) >= before[0] + 1, 10)
    assert client.run_on_scheduler(_malformed) == before[1]
    del out


@pytest.mark.parametrize("record", [
    {"token": REAL, "ranks": 10**9, "chunks": 1},
    {"token": REAL, "ranks": -1, "chunks": 1},
    {"token": REAL, "ranks": 2, "chunks": 10**9},
    {"token": REAL, "ranks": 2, "chunks": 1, "nbytes": -5},
    {"token": REAL, "ranks": 2, "chunks": 1, "widths": list(range(100_000))},
    {"token": REAL, "ranks": 2, "chunks": 1, "workers": ["w"] * 3},
    {"token": REAL, "ranks": 2, "chunks": 1, "algorithm": "x" * 10_000},
    {"token": REAL, "ranks": 2, "chunks": 1, "predicted": float("nan")},
    {"token": REAL, "ranks": 2, "chunks": 1, "segment_bytes": float("-inf")},
    {"token": None},
    ["token"],
], ids=["huge-ranks", "negative-ranks", "huge-chunks", "negative-bytes", "huge-widths",
        "more-workers-than-ranks", "huge-text", "nan-predicted", "negative-segment", "none-token", "list"])
def test_publish_refuses_malformed_records_and_unknown_calls(client, record):
    ws = workers_of(client)
    out = flowreduce.allreduce(client, [client.submit(np.ones, N, workers=[w]) for w in ws], algorithm="ring")
    client.gather(out)
    if isinstance(record, dict) and record.get("token") is REAL:
        record = {**record, "token": flowreduce.describe(out).token}
    before = client.run_on_scheduler(_malformed)
    refused_at(client, "scheduler", PUBLISH, lambda: client._send_to_scheduler({"op": PUBLISH, "record": record}))
    assert client.run_on_scheduler(_malformed) == before + 1


# -- the workers ----------------------------------------------------------------------------------------

async def _ask(client, address, **kwargs):
    return await getattr(client.rpc(address), HANDLER)(**kwargs)


def reduce_held(client, address, **kwargs):
    return client.sync(_ask, client, address, **kwargs)


class _Writes:
    """Unpickled, opens (creates) ``path`` for writing: what a pickled reduction could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_reduce_held_takes_an_op_by_name_never_a_pickled_callable(client, tmp_path):
    ws = workers_of(client)
    xs = [client.scatter(np.full(N, r + 1.0), workers=[ws[0]], hash=False) for r in range(2)]
    keys = [x.key for x in xs]
    ok = reduce_held(client, ws[0], keys=keys, reduce_with="sum")
    assert ok["status"] == "OK"
    np.testing.assert_array_equal(ok["value"], np.full(N, 3.0))
    hostile = [
        ({"keys": keys, "reduce_with": pickle.dumps(_Writes(tmp_path / "pwned"))}, "pickled"),  # a pickled callable
        ({"keys": keys, "reduce_with": "system"}, "unknown op"),
        ({"keys": keys, "reduce_with": "__import__"}, "unknown op"),
        ({"keys": keys, "reduce_with": None}, "name of an op"),
        ({"keys": keys, "reduce_with": ["sum"]}, "name of an op"),
        ({"keys": keys, "reduce_with": "x" * 10_000}, "name of an op"),
        ({"keys": None, "reduce_with": "sum"}, "list of 1 to"),
        ({"keys": "a-key", "reduce_with": "sum"}, "list of 1 to"),
        ({"keys": {"k": 1}, "reduce_with": "sum"}, "list of 1 to"),
        ({"keys": [], "reduce_with": "sum"}, "list of 1 to"),
        ({"keys": [[{"k": 1}]], "reduce_with": "sum"}, "Dask keys"),
        ({"keys": ["k"] * (MAX_HELD_KEYS + 1), "reduce_with": "sum"}, "list of 1 to"),
        ({"keys": keys, "reduce_with": "sum", "evil": 1}, "unknown arguments"),
    ]
    for kwargs, why in hostile:
        def send(kwargs=kwargs, why=why):
            reply = reduce_held(client, ws[0], **kwargs)
            assert reply["status"] == "error" and why in reply["message"], (kwargs, reply)
            return reply

        refused_at(client, ws[0], HANDLER, send)
    assert not os.path.exists(tmp_path / "pwned")
    # keys not held here: what a reader racing a release or a move asks too, so answered, not logged as an error
    missing = reduce_held(client, ws[0], keys=["not-held-here", *keys], reduce_with="sum")
    assert missing["status"] == "missing" and "1 of the 3 keys are not held here" in missing["message"]


# -- names of segments and links that peers hand over ---------------------------------------------------

@pytest.mark.parametrize("name", TRAVERSALS, ids=stable_id)
def test_a_handle_naming_anything_but_a_pool_segment_is_refused(client, name):
    """A handle is what a peer's value is, pickled: the reader maps the segment it names."""
    ws = workers_of(client)
    handle = Handle(name, 1 << 20, 1, (("<f8", 0, 8),))
    refused_at(client, ws[0], "refused shared-memory segment",
               lambda: _raises_refused(client.submit(received, handle, pure=False, workers=[ws[0]]),
                                       "not a flowreduce segment name"))


@pytest.mark.parametrize("size,pieces,why", [
    (-1, (("<f8", 0, 8),), "size must be an int"), (10**15, (("<f8", 0, 8),), "size must be an int"),
    ("64", (("<f8", 0, 8),), "size must be an int"), (1 << 20, (("<f8", -64, 8),), "does not lie inside"),
    (1 << 20, (("<f8", 0, 1 << 20),), "does not lie inside"), (1 << 20, (("O", 0, 8),), "is not a plain dtype"),
    (1 << 20, ((None, 0, 8),), "is not a plain dtype"), (1 << 30, (("<f8", 0, 8),), "the file has")],
                         ids=["negative-size", "huge-size", "string-size", "negative-offset", "past-the-end",
                              "object-dtype", "no-dtype", "larger-than-the-file"])
def test_a_handle_with_sizes_outside_its_segment_is_refused(client, shm_dir, size, pieces, why):
    ws = workers_of(client)
    name = f"{shm_pool.PREFIX}{os.getpid()}-0-{uuid.uuid4().int % 10**9}"  # a plain segment of this user
    path = os.path.join(shm_dir, name)
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    try:
        handle = Handle(name, size, 0, pieces)
        refused_at(client, ws[0], "refused shared-memory",
                   lambda: _raises_refused(client.submit(received, handle, pure=False, workers=[ws[0]]), why))
    finally:
        os.unlink(path)


def test_a_segment_name_that_is_a_link_out_of_the_pool_is_not_followed(client, shm_dir, tmp_path):
    ws = workers_of(client)
    target = tmp_path / "outside"
    target.write_bytes(b"\0" * (1 << 20))
    name = f"{shm_pool.PREFIX}{os.getpid()}-0-{uuid.uuid4().int % 10**9}"
    os.symlink(target, os.path.join(shm_dir, name))
    try:
        handle = Handle(name, 1 << 20, 0, (("<f8", 0, 8),))
        refused_at(client, ws[0], "refused shared-memory segment",
                   lambda: _raises_refused(client.submit(received, handle, pure=False, workers=[ws[0]]),
                                           "resolves outside"))
    finally:
        os.unlink(os.path.join(shm_dir, name))
    assert target.read_bytes() == b"\0" * (1 << 20)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_segment_name_that_is_not_a_plain_file_is_refused(client, shm_dir, kind):
    ws = workers_of(client)
    name = f"{shm_pool.PREFIX}{os.getpid()}-0-{uuid.uuid4().int % 10**9}"
    path = os.path.join(shm_dir, name)
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    try:
        handle = Handle(name, 1 << 20, 0, (("<f8", 0, 8),))
        refused_at(client, ws[0], "refused shared-memory segment",
                   lambda: _raises_refused(client.submit(received, handle, pure=False, workers=[ws[0]]),
                                           "not a regular file"))
    finally:
        os.rmdir(path) if kind == "directory" else os.unlink(path)


def _find(token, rank) -> str:
    """What a reader makes of the post of (token, rank) in its worker's pool."""
    got = shm_posts.find(shm_pool.pool(), token, rank)
    return type(got).__name__ if got is not None and not isinstance(got, str) else repr(got)


@pytest.mark.parametrize("target,why", [
    (f"../../tmp/{os.path.basename(EVIL)}:{1 << 20}:1:64:64", "not a flowreduce segment name"),
    (f"{EVIL}:{1 << 20}:1:64:64", "not a flowreduce segment name"),
    ("flowreduce-shm-1-2-3:many:1:64:64", "not one of a post"),
    ("flowreduce-shm-1-2-3:-1:1:64:64", "size must be an int"),
    ("OUTSIDE:1048576:0:64:64", "resolves outside")],
    ids=["traversal", "absolute", "string-size", "negative-size", "link-out-of-the-pool"])
def test_a_post_whose_link_names_anything_but_a_pool_segment_is_refused(client, shm_dir, tmp_path, target, why):
    """A reader writes its acknowledgement into the segment a post names:
    never into a file outside the pool, nor through a link."""
    ws = workers_of(client)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * (1 << 20))
    segment = None
    if target.startswith("OUTSIDE"):
        segment = f"{shm_pool.PREFIX}{os.getpid()}-0-{uuid.uuid4().int % 10**9}"
        os.symlink(outside, os.path.join(shm_dir, segment))
        target = target.replace("OUTSIDE", segment)
    token = uuid.uuid4().hex
    link = os.path.join(shm_dir, shm_posts.name(token, 0))
    os.symlink(target, link)
    try:
        before = len(heard(client, ws[0], 0))
        assert client.submit(_find, token, 0, pure=False, workers=[ws[0]]).result() == repr(shm_posts.UNFIT)
        assert [m for m in heard(client, ws[0], before + 1)[before:] if "refused shared-memory" in m and why in m]
    finally:
        os.unlink(link)
        if segment is not None:
            os.unlink(os.path.join(shm_dir, segment))
    assert outside.read_bytes() == b"\0" * (1 << 20)


def _raises_refused(future, why: str) -> None:
    with pytest.raises(shm_pool.Refused, match=why):
        future.result()


@pytest.mark.parametrize("settings", [{"directory": "../../tmp"}, {"directory": "/nonexistent-dir"},
                                      {"directory": None}, {"pool-bytes": -1}, {"pool-bytes": "lots"},
                                      {"memory-fraction": 7}, {"idle-seconds": float("nan")}, {"enabled": "yes"},
                                      {"evil": 1}, ["directory"]], ids=repr)
def test_pool_settings_a_client_sends_are_checked(settings):
    """:class:`~flowreduce.schedule.shm_plugin.SharedMemoryPlugin` carries
    them to every worker; the worker keeps its own configuration when they are refused."""
    assert shm_pool.settings_refusal(settings) is not None
    assert shm_pool.settings_refusal(shm_pool.config()) is None


@pytest.mark.parametrize("token,rank", [("../../tmp/evil", 0), ("a/b", 0), ("a\x00b", 0), (None, 0), ("abc", "../1"),
                                        ("abc", -1), ("abc", True)], ids=repr)
def test_post_links_are_named_from_a_plain_token_and_rank(token, rank):
    """A post's link is named from the task's key (its call's token) and a rank."""
    with pytest.raises(shm_pool.Refused, match="not a plain token and rank"):
        shm_posts.name(token, rank)


@pytest.mark.parametrize("link", [f"../{os.path.basename(EVIL)}", EVIL, "flowreduce-shm-post-a/../../b-0",
                                  "flowreduce-shm-post-a-0\x00", "flowreduce-shm-1-2-3", None], ids=stable_id)
def test_the_pool_makes_and_removes_links_only_under_post_names(shm_dir, link):
    pool = shm_pool.Pool(shm_dir)
    with pytest.raises(shm_pool.Refused, match="not a flowreduce link name"):
        pool.link(link, f"{pool.stem}:{shm_posts.UNFIT}")
    with pytest.raises(shm_pool.Refused, match="not a flowreduce link name"):
        pool.unlink_link(link)
    assert not os.path.lexists(EVIL) and not [n for n in os.listdir(shm_dir) if n.startswith(shm_pool.PREFIX + shm_pool.LINK)]


def maximum(a, b):  # a user's callable that shares a ufunc's name
    return np.maximum(a, b)


@pytest.mark.parametrize("op,name", [("sum", "sum"), ("mean", "mean"), (np.maximum, "maximum"), ("logaddexp", "logaddexp"),
                                     (maximum, None), (lambda a, b: a + b, None)], ids=stable_id)
def test_readers_ask_peers_for_a_reduction_by_name_only(op, name):
    """A user's callable is never sent to a peer (it would have to be pickled):
    the reader reads that peer's values and reduces them itself."""
    assert named_op(resolve_op(op)) == name
