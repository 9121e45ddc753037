"""``flowreduce calibrate``: the α-β fit, the link classes it measures, and
the file that ``allreduce``, ``bench`` and ``trace`` read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from utils import workers_of

from flowreduce import cli
from flowreduce.calibration import calibrate, fit_link, worker_pairs
from flowreduce.cost import CostModel, Link

SIZES = [8, 1_000, 10_000, 1_000_000, 4_000_000, 16_000_000]


@pytest.mark.parametrize("alpha,beta", [(12e-3, 8e-8), (4e-3, 1e-9), (0.0, 1e-8)],
                         ids=["100mbit", "loopback", "no-latency"])
def test_fit_recovers_known_alpha_and_beta(alpha, beta):
    x = np.array(SIZES * 3, dtype=float)
    exact = alpha + beta * x
    link, err = fit_link(x, exact)
    assert link.alpha == pytest.approx(alpha, abs=1e-9) and link.beta == pytest.approx(beta, rel=1e-6)
    assert err == pytest.approx(0.0, abs=1e-9)
    noisy = exact * np.random.default_rng(0).lognormal(0.0, 0.03, size=x.size)  # 3% jitter
    link, err = fit_link(x, noisy)
    assert link.alpha == pytest.approx(alpha, rel=0.1, abs=2e-4)
    assert link.beta == pytest.approx(beta, rel=0.1)
    assert 0.005 < err < 0.1


@pytest.mark.parametrize("x,y,match", [
    ([8, 8, 8], [1e-3, 1e-3, 1e-3], "at least two distinct sizes"),
    ([8, 1000], [1e-3, 0.0], "positive and finite"),
    ([8, 1000], [1e-3], "as many sizes as times"),
], ids=["one-size", "zero-time", "lengths"])
def test_fit_rejects_bad_samples(x, y, match):
    with pytest.raises(ValueError, match=match):
        fit_link(x, y)


def test_link_classes_from_faked_hosts(inproc_client, monkeypatch):
    import flowreduce.schedule.hosts as hosts

    client = inproc_client
    ws = workers_of(client)
    table = {ws[0]: "a", ws[1]: "b", ws[2]: "a", ws[3]: "b"}
    monkeypatch.setattr(hosts, "place_of", lambda dask_worker=None: (table[dask_worker.address], ""))
    pairs = worker_pairs(client)
    assert set(pairs) == {"intra", "inter"}
    a, b = pairs["intra"]
    assert table[a] == table[b] and a != b
    a, b = pairs["inter"]
    assert table[a] != table[b]
    model, meta = calibrate(client, small=(8, 1000), large=(100_000,), hops=4, repeat=1)
    assert isinstance(model.intra, Link) and isinstance(model.inter, Link)
    assert {s["link"] for s in meta["samples"]} == {"intra", "inter"}
    assert len(meta["samples"]) == 6


def test_calibrate_writes_a_file_that_bench_reads(proc_client, tmp_path, capsys):
    addr = proc_client.scheduler.address
    path = tmp_path / "model.json"
    rc = cli.main(["calibrate", "--scheduler", addr, "-o", str(path), "--small", "8,1000", "--large", "200000",
                   "--hops", "4", "--repeat", "1"])
    assert rc == 0
    model = CostModel.from_file(path)
    data = json.loads(path.read_text())
    assert model.intra is not None and model.inter is None  # one host: only the intra class
    assert data["measured"]["fits"]["intra"]["alpha"] == model.intra.alpha
    # bench reads the file: a model that charges 100 s per call shows in every row's prediction
    slow = tmp_path / "slow.json"
    CostModel(call=100.0).to_file(slow)
    out = tmp_path / "rows.json"
    rc = cli.main(["bench", "--scheduler", addr, "--cost-model", str(slow), "--sizes", "1000", "--algorithms",
                   "ring,auto", "--repeat", "1", "--warmup", "0", "--no-baseline", "--no-progress",
                   "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert {r["algorithm"] for r in rows} == {"ring", "auto"}
    assert all(100.0 <= r["predicted"] < 101.0 for r in rows)
    capsys.readouterr()


def test_missing_model_file_is_reported(proc_client, tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(["bench", "--scheduler", proc_client.scheduler.address, "--cost-model",
                  str(tmp_path / "nothing.json"), "--sizes", "10", "--repeat", "1", "--no-progress"])
