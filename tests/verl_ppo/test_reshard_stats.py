"""``ReshardStats`` pack / wire / unpack times on a tiny Llama with many small buckets
(2 gloo processes, CPU): each is at most the wall time, and the per-bucket records of the
recorder add up to the wire time, not more (consecutive buckets overlap on the wire)."""

import pytest

from verl_comm.distributed.launch import spawn
from verl_comm.telemetry import CommRecorder
from verl_ppo.reshard.engine import ReshardEngine
from verl_ppo.reshard.executor import union_length
from verl_ppo.reshard.layout import ParallelLayout as L
from verl_ppo.reshard.testing import (
    emulated_train_shards,
    expected_rollout,
    random_full_state,
    tiny_config,
)


def worker_2(rank: int, world: int) -> list[dict]:
    import torch

    out = []
    for transport in ("all_to_all", "p2p"):
        rec = CommRecorder()
        eng = ReshardEngine(
            tiny_config("llama"), L(pp=2), L(tp=2), bucket_bytes=512, transport=transport,
            recorder=rec,
        )  # fmt: skip
        full = random_full_state(eng.plan.specs, seed=3)
        got = eng.reshard(emulated_train_shards(eng.plan, rank, full))
        exp = expected_rollout(eng.plan, rank, full)
        s = eng.last_stats
        out.append(
            {
                "equal": all(torch.equal(got[k], exp[k]) for k in exp),
                "stats": dict(vars(s)),
                "records": [r.duration_s for r in rec.records],
                "in_flight": [r.extra["in_flight_s"] for r in rec.records],
            }
        )
    return out


def test_union_length():
    assert union_length([]) == 0.0
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)


@pytest.mark.timeout(300)
def test_pack_wire_unpack_each_within_wall_time():
    for per_transport in spawn(f"{__file__}:worker_2", 2, timeout_s=240):
        for r in per_transport:
            s = r["stats"]
            assert r["equal"]
            assert s["buckets"] >= 20, s  # many small buckets: the overlap case
            wall = s["time_s"]
            for key in ("pack_s", "wire_s", "unpack_s", "local_s"):
                assert 0.0 < s[key] <= wall, (key, s)
            # host-side copies run one after another: together within the wall time too
            assert s["pack_s"] + s["unpack_s"] + s["local_s"] <= wall, s
            assert len(r["records"]) == s["buckets"]
            assert sum(r["records"]) == pytest.approx(s["wire_s"], rel=1e-6, abs=1e-9)
            assert sum(r["records"]) <= wall
            assert sum(r["in_flight"]) >= sum(r["records"])  # raw intervals overlap
