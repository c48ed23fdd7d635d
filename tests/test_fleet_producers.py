"""Several producers by dataset on one Redis (docs/benchmarks.md, "Ceiling"): each producer's
config names its own datasets, one pool of workers serves them all (workers read the
registered datasets from Redis), and every producer ends with exactly its rows."""

from __future__ import annotations

import yaml

from budgetq.shared import keys
from tests.helpers import Procs, rows, write_config, write_dataset


def test_two_producers_split_by_dataset_share_one_redis_and_one_worker(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--length-mean", "20")
    ids = {ds: write_dataset(tmp_path / f"{ds}.jsonl", 40, start=100 * k) for k, ds in enumerate(("A", "B"))}
    cfgs = {}
    for ds in ("A", "B"):
        d = tmp_path / ds
        d.mkdir()
        spec = {"name": ds, "path": str(tmp_path / f"{ds}.jsonl"), "budget": 10**9, "id_field": "id",
                "sampling": {"max_tokens": 64}}
        cfgs[ds] = write_config(d, redis_url, [sim], [spec], producer={"progress": "off"})
    # The worker's config names both datasets' output; it serves whatever Redis has registered.
    both = yaml.safe_load(cfgs["A"].read_text())
    both["datasets"] += yaml.safe_load(cfgs["B"].read_text())["datasets"]
    (tmp_path / "w").mkdir()
    wcfg = tmp_path / "w" / "cfg.yaml"
    wcfg.write_text(yaml.safe_dump(both))
    workers = Procs(wcfg, tmp_path)
    producers = {ds: Procs(cfgs[ds], tmp_path / ds) for ds in cfgs}
    try:
        workers.worker()
        started = {ds: p.producer() for ds, p in producers.items()}
        for proc in started.values():
            assert proc.wait(120) == 0, Procs.log(proc)
    finally:
        for p in (*producers.values(), workers):
            p.stop_all()
    for ds in ("A", "B"):
        got = rows(tmp_path / ds / "out" / f"{ds}.jsonl")
        assert sorted(r["id"] for r in got) == sorted(ids[ds])
        other = "B" if ds == "A" else "A"
        assert not (tmp_path / ds / "out" / f"{other}.jsonl").exists()
        assert int(conn.hget(keys.stats_key(ds), "committed")) == 40
