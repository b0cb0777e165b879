"""Single-process tests of verl_comm.profiler: intervals, lifecycle, gating, disabled mode,
config, Chrome trace, report CLI and diagnosis on hand-made profiles."""

from __future__ import annotations

import json
import time

import pytest

from verl_comm.profiler import Thresholds, VerlProfiler, diagnose
from verl_comm.profiler import intervals as iv
from verl_comm.profiler.analysis import analyze_rank, analyze_run, find_runs
from verl_comm.profiler.cli import main as profile_main
from verl_comm.profiler.phases import PhaseTimer
from verl_comm.telemetry import CommRecorder


def test_interval_algebra():
    assert iv.union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert iv.total([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert iv.clip([(0, 2), (3, 4)], 1, 3.5) == [(1, 2), (3, 3.5)]
    assert iv.subtract([(0, 10)], [(1, 2), (4, 6), (9, 12)]) == [(0, 1), (2, 4), (6, 9)]
    assert iv.gaps([(1, 2), (1.5, 3)], 0, 4) == [(0, 1), (3, 4)]
    assert iv.subtract([(0, 1)], []) == [(0, 1)]


def test_disabled_profiler_is_a_no_op(tmp_path):
    prof = VerlProfiler(enabled=False, output_dir=tmp_path / "p")
    with prof:
        a, b = prof.phase("gen"), prof.phase("reward")
        assert a is b  # one shared null context: nothing allocated per call
        with a:
            pass
        prof.step()
        prof.record_rollout(1.0)
    assert prof.stop() is None
    assert not (tmp_path / "p").exists()
    assert prof.step_index == 1 and not prof.active
    assert not prof.recorder.enabled
    with pytest.raises(RuntimeError, match="stopped profiler"):
        prof.export_chrome_trace(tmp_path / "t.json")


def test_phase_timer_and_profiler_share_one_measurement(tmp_path):
    prof = VerlProfiler(output_dir=tmp_path, torch_profiler=False, steps=[0], sync_ranks=False)
    timer = PhaseTimer(profiler=prof)
    with prof:
        for nap in (0.004, 0.002):  # one phase entered twice: its times add up
            with timer.phase("gen"):
                time.sleep(nap)
        with timer.phase("reward"):
            with prof.phase("inner"):  # the profiler's own phases nest inside the timer's
                pass
        prof.step()  # step 1 is not profiled: the timer times it, the profiler records nothing
        later = PhaseTimer(profiler=prof)
        with later.phase("gen"):
            time.sleep(0.001)
    recorded = prof.to_dict()["phases"]
    assert [(p["name"], p["depth"]) for p in recorded] == [
        ("gen", 0), ("gen", 0), ("inner", 1), ("reward", 0)
    ]  # fmt: skip
    # bit-equal on purpose: the timer's seconds are the t1 - t0 the profiler recorded (one
    # measurement of each block, not two nested ones)
    gens = [p["t1"] - p["t0"] for p in recorded if p["name"] == "gen"]
    assert timer.times["gen"] == gens[0] + gens[1] and timer.times["gen"] >= 0.006
    assert timer.times["reward"] == next(
        p["t1"] - p["t0"] for p in recorded if p["name"] == "reward"
    )
    m = timer.metrics()
    assert m["timing_s/step"] == pytest.approx(
        timer.times["gen"] + timer.times["reward"], rel=1e-12
    )
    assert later.times["gen"] >= 0.001 and not timer.peaks  # no CUDA sync asked: no peaks


def test_from_config_mapping_object_and_none(tmp_path):
    class Cfg:
        enable = True
        steps = [2, 1]
        output_dir = str(tmp_path)

    p = VerlProfiler.from_config(Cfg())
    assert p.enabled and p.steps == [1, 2] and p.output_dir == tmp_path
    assert VerlProfiler.from_config({"enable": True, "steps": []}).steps is None  # [] = all
    q = VerlProfiler.from_config({"enable": False})
    assert not q.enabled
    assert not VerlProfiler.from_config(None).enabled
    rec = CommRecorder()
    assert VerlProfiler.from_config({"enable": True}, recorder=rec).recorder is rec
    with pytest.raises(ValueError, match="steps"):
        VerlProfiler(steps=[-1])


def test_steps_gating_and_profile_contents(tmp_path):
    import torch

    # on CUDA the profiler samples the CUDA allocator: hold something there
    held = torch.ones(1 << 20, device="cuda") if torch.cuda.is_available() else None
    prof = VerlProfiler(output_dir=tmp_path, steps=[1, 2], torch_profiler=False)
    prof.start()
    for _ in range(4):
        with prof.phase("gen"):
            time.sleep(0.01)
            with prof.phase("reshard"):
                with prof.recorder.timed("all_to_all", 1000, 2, "reshard/bucket0"):
                    time.sleep(0.005)
        with prof.phase("update_actor"):
            with prof.recorder.timed("all_reduce", 4000, 2, "hook/int8"):
                time.sleep(0.01)
        prof.record_rollout(0.5, batch_size=8)
        prof.step()
    path = prof.stop()
    data = json.loads(path.read_text())
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert {p["step"] for p in data["phases"]} == {1, 2}
    assert [p["depth"] for p in data["phases"] if p["name"] == "reshard"] == [1, 1]
    assert all(p["mem_peak"] > 0 for p in data["phases"])
    assert len(data["rollouts"]) == 2
    # the recorder is enabled all along (the hooks record into it); the profile keeps
    # only the records made from start() on
    assert len(data["comm"]) == 8
    m = analyze_rank(data)
    assert m["reshard"]["enabled"] and m["reshard"]["bytes"] == 2000  # only in-step records
    assert m["phases"]["reshard"]["share"] is None  # nested: not part of the shares
    assert m["phases"]["gen"]["share"] + m["phases"]["update_actor"]["share"] <= 1.0
    assert m["rollout"]["source"] == "record_rollout" and m["rollout"]["p50"] == 0.5
    assert m["comm"]["share_of_backward"] == pytest.approx(1.0, abs=0.15)
    assert not (tmp_path / "trace_rank0.json").exists()
    del held


def test_chrome_trace_is_valid_json_and_report_runs(tmp_path, capsys):
    prof = VerlProfiler(output_dir=tmp_path / "run")
    with prof:
        for _ in range(3):
            with prof.phase("gen"):
                time.sleep(0.005)
            with prof.phase("reward"):
                time.sleep(0.002)
            prof.step()
    out = prof.export_chrome_trace(tmp_path / "copy" / "trace.json")
    trace = json.loads(out.read_text())
    assert isinstance(trace["traceEvents"], list)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"phase::gen", "phase::reward"} <= names
    assert json.loads((tmp_path / "run" / "trace_rank0.json").read_text()) == trace
    assert profile_main(["report", str(tmp_path / "run"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metrics"]["steps"]["n"] == 3
    assert doc["flat"]["timing_s/gen"] == doc["metrics"]["phases"]["gen"]["per_step_s"] >= 0.005
    assert "comm/share_of_step" in doc["flat"]
    assert [s["id"] for s in doc["diagnosis"]["symptoms"]] == [1, 2, 3, 4]
    assert doc["diagnosis"]["symptoms"][0]["found"] is None  # 3 steps < min_samples


def test_report_cli_errors(tmp_path, capsys):
    assert profile_main(["report", str(tmp_path / "missing")]) == 2
    assert profile_main(["report", str(tmp_path)]) == 2
    assert "profile_rank" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        find_runs(tmp_path)
    (tmp_path / "profile_rank0.json").write_text("{bad")
    assert profile_main(["report", str(tmp_path)]) == 2
    assert profile_main(["report", str(tmp_path), "--comm-share", "2"]) == 2


def _synthetic(step_times, comm_s, phase="update_actor", host=0.0, gen=None):
    """A hand-made rank profile: each step = [host phase][phase with comm at its end]."""
    steps, phases, comm = [], [], []
    t = 100.0
    for i, dur in enumerate(step_times):
        steps.append({"step": i, "t0": t, "t1": t + dur})
        cur = t
        if gen is not None:
            phases.append({"name": "gen", "step": i, "depth": 0, "t0": cur, "t1": cur + gen[i]})
            cur += gen[i]
        if host:
            phases.append({"name": "reward", "step": i, "depth": 0, "t0": cur, "t1": cur + host})
            cur += host
        phases.append({"name": phase, "step": i, "depth": 0, "t0": cur, "t1": t + dur})
        c = comm_s[i]
        comm.append(
            {
                "op": "all_reduce",
                "nbytes": 10**6,
                "group_size": 2,
                "duration_s": c,
                "tag": "hook",
                "start_s": t + dur - c,
                "extra": {},
            }
        )
        t += dur
    meta = {"rank": 0, "world_size": 1, "device": "cpu", "cuda": False, "overhead_s": 0.0}
    return {
        "meta": meta,
        "steps": steps,
        "phases": phases,
        "comm": comm,
        "torch_comm": [],
        "kernels": [],
    }


def _run(tmp_path, data):
    (tmp_path / "profile_rank0.json").write_text(json.dumps(data))
    m = analyze_run(tmp_path)
    return m, diagnose(m)


def test_diagnosis_thresholds_on_synthetic_profiles(tmp_path):
    m, d = _run(tmp_path, _synthetic([1.0] * 8, [0.1] * 8))
    assert d["found"] == []
    assert m["comm"]["share_of_step"] == pytest.approx(0.1)

    m, d = _run(tmp_path, _synthetic([1.0] * 8, [0.5] * 8))
    assert d["found"] == [3]
    assert d["symptoms"][2]["values"]["share_of_step"] == pytest.approx(0.5)

    times = [1.0] * 7 + [2.0]
    m, d = _run(tmp_path, _synthetic(times, [0.1] * 7 + [1.1]))
    assert 1 in d["found"]
    v = d["symptoms"][0]["values"]
    assert v["slowest_excess_s"] == pytest.approx(1.0) and v["excess_comm_s"] == pytest.approx(1.0)
    assert "collective blocking" in d["symptoms"][0]["likely_causes"][0]

    m, d = _run(tmp_path, _synthetic([1.0] * 8, [0.05] * 8, host=0.6))
    assert d["found"] == [2]

    gen = [0.2] * 7 + [0.6]
    m, d = _run(tmp_path, _synthetic([1.0] * 8, [0.05] * 8, gen=gen))
    assert d["found"] == [4]
    assert m["rollout"]["max"] == pytest.approx(0.6)

    with pytest.raises(ValueError, match="jitter_ratio"):
        diagnose(m, Thresholds(jitter_ratio=0.5))


def test_device_timeline_exposed_comm_and_idle_gaps(tmp_path):
    """GPU path of the analysis on a hand-made device timeline (NCCL kernels + compute)."""
    t = 10.0
    steps, phases, kernels = [], [], []
    for i in range(5):
        steps.append({"step": i, "t0": t, "t1": t + 1.0})
        phases.append({"name": "update_actor", "step": i, "depth": 0, "t0": t, "t1": t + 0.65})
        phases.append({"name": "reward", "step": i, "depth": 0, "t0": t + 0.65, "t1": t + 1.0})
        kernels.append({"name": "gemm", "t0": t, "t1": t + 0.4, "comm": False})
        kernels.append(
            {"name": "ncclDevKernel_AllReduce", "t0": t + 0.25, "t1": t + 0.65, "comm": True}
        )
        t += 1.0
    torch_comm = [dict(k, source="kernel") for k in kernels if k["comm"]]
    meta = {"rank": 0, "world_size": 2, "device": "H200", "cuda": True, "overhead_s": 0.01}
    data = {
        "meta": meta,
        "steps": steps,
        "phases": phases,
        "comm": [],
        "torch_comm": torch_comm,
        "kernels": kernels,
    }
    m, d = _run(tmp_path, data)
    c = m["comm"]
    assert c["source"].startswith("NCCL kernels")
    assert c["per_step_s"] == pytest.approx(0.4)
    assert c["exposed_s"] == pytest.approx(5 * 0.25)  # 0.4..0.65 not hidden by the gemm
    assert c["share_of_backward"] == pytest.approx(0.4 / 0.65)
    idle = m["gpu_idle"]
    assert idle["share"] == pytest.approx(0.35)
    assert idle["by_phase_s"] == {"reward": pytest.approx(5 * 0.35)}
    assert d["found"] == [2, 3]  # device idle in reward 35% > 30%; comm 40% > 35%
    assert d["symptoms"][1]["values"]["gpu_idle_share"] == pytest.approx(0.35)


def test_nccl_kernel_args_give_collective_and_bytes():
    from verl_comm.profiler.torch_events import collective_args

    args = {"Collective name": "allreduce", "In msg nelems": 1000, "dtype": "BFloat16",
            "Group size": 2}  # fmt: skip
    assert collective_args(args) == {"collective": "allreduce", "group_size": 2, "in_bytes": 2000}
    assert collective_args({"In msg nelems": 10, "dtype": "Float"}) == {"in_bytes": 40}
    assert collective_args({"In msg nelems": "x", "dtype": "Float"}) == {}  # unknown -> left out
    assert collective_args({}) == {}


def test_gloo_work_event_shapes_give_bytes():
    from verl_comm.profiler.torch_events import gloo_input_bytes

    args = {"Input Dims": [[4, 10]], "Input type": ["c10::BFloat16"]}
    assert gloo_input_bytes(args) == {"in_bytes": 80}
    assert gloo_input_bytes({"Input Dims": [[7]], "Input type": ["signed char"]}) == {"in_bytes": 7}
    assert gloo_input_bytes({"Input Dims": [[7]], "Input type": ["mystery"]}) == {}
    assert gloo_input_bytes({}) == {}


def test_wire_bytes_leave_out_reducer_envelopes_and_count_nccl_input(tmp_path):
    """The reducer's bucket record wraps its hook's: payload, not wire bytes. NCCL kernel
    input bytes (from torch.profiler's args) are summed over the profiled steps."""
    data = _synthetic([1.0] * 5, comm_s=[0.1] * 5)
    t0 = data["steps"][0]["t0"]
    data["comm"] = [
        {"op": "bucket_reduce", "nbytes": 4000, "group_size": 2, "duration_s": 0.1,
         "tag": "reducer/bucket0", "start_s": t0 + 0.1},
        {"op": "int8", "nbytes": 1040, "group_size": 2, "duration_s": 0.09,
         "tag": "hook/int8/bucket0", "start_s": t0 + 0.1},
    ]  # fmt: skip
    data["torch_comm"] = [
        {"name": "ncclDevKernel_AllReduce", "t0": s["t0"] + 0.2, "t1": s["t0"] + 0.7,
         "comm": True, "source": "kernel", "collective": "allreduce", "in_bytes": 512}
        for s in data["steps"]
    ] + [
        {"name": "ncclDevKernel_AllReduce", "t0": t0 - 5.0, "t1": t0 - 4.9, "comm": True,
         "source": "kernel", "collective": "allreduce", "in_bytes": 10**9},  # outside steps
    ]  # fmt: skip
    data["kernels"] = [
        {"name": e["name"], "t0": e["t0"], "t1": e["t1"], "comm": True} for e in data["torch_comm"]
    ]
    m, d = _run(tmp_path, data)
    assert m["comm"]["bytes_total"] == 1040 and m["comm"]["payload_bytes"] == 4000
    assert m["comm"]["torch_input_bytes"] == 5 * 512
    assert m["comm"]["torch_ops"] == {"nccl allreduce": 6}
    assert 3 in d["found"]  # 0.5 s of NCCL kernel time in each 1 s step
    comm = d["symptoms"][2]
    assert comm["values"]["hook_methods"] == ["int8"]
    assert "already int8" in comm["remedy"][0]  # no "turn int8 on" advice when it is on


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_path_kernels_memory_snapshot_idle(tmp_path):
    """On a GPU: CUDA kernels land in the device summary, phases hold the CUDA allocator's
    peak, the ``torch.cuda.memory`` snapshot is written and idle gaps are attributed."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    prof = VerlProfiler(output_dir=tmp_path / "prof", steps=[1, 2, 3, 4, 5])
    prof.start()
    for _ in range(6):
        with prof.phase("update_actor"):
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
        with prof.phase("reward"):
            time.sleep(0.02)  # host work: the device idles
        prof.step()
    prof.stop()
    data = json.loads((tmp_path / "prof" / "profile_rank0.json").read_text())
    assert data["meta"]["cuda"] and len(data["steps"]) == 5
    assert data["kernels"] == [] and data["device"]["kernel_count"] >= 5 * 20
    assert (tmp_path / "prof" / "memory_snapshot_rank0.pickle").stat().st_size > 0
    m = analyze_run(tmp_path / "prof")
    assert m["phases"]["update_actor"]["mem_peak"] >= 3 * 2048 * 2048 * 4
    assert m["gpu_idle"]["by_phase_s"]["reward"] == pytest.approx(5 * 0.02, rel=0.5)


def _nccl_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    g = torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
    prof = VerlProfiler(output_dir=out_dir, steps=[1, 2, 3])
    prof.start()
    for _ in range(4):
        with prof.phase("update_actor"):
            dist.all_reduce(g)
        prof.step()
    prof.stop()
    dist.destroy_process_group()


@pytest.mark.skipif(
    __import__("torch").cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, one per rank)"
)
def test_nccl_kernels_are_communication_with_their_bytes(tmp_path):
    """On 2 GPUs: NCCL all-reduce kernels are found as communication, with the input bytes
    read from torch.profiler's kernel args."""
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(str(tmp_path / "store"), str(tmp_path / "prof")), nprocs=2)
    data = json.loads((tmp_path / "prof" / "profile_rank0.json").read_text())
    comm = [e for e in data["torch_comm"] if e["source"] == "kernel"]
    assert len(comm) == 3 and all(e.get("in_bytes") == 2 << 20 for e in comm), comm[:2]
    m = analyze_run(tmp_path / "prof")
    assert m["comm"]["source"].startswith("NCCL kernels")
    assert m["comm"]["torch_input_bytes"] == 3 * (2 << 20)


def test_idle_gpu_in_gen_names_launch_bound_decoding_and_cuda_graphs(tmp_path):
    """Device idle inside 'gen' (many short kernels with gaps) -> CUDA-graph decoding."""
    steps, phases, kernels = [], [], []
    t = 10.0
    for i in range(5):
        steps.append({"step": i, "t0": t, "t1": t + 1.0})
        phases.append({"name": "gen", "step": i, "depth": 0, "t0": t, "t1": t + 0.7})
        phases.append({"name": "update_actor", "step": i, "depth": 0, "t0": t + 0.7, "t1": t + 1})
        for j in range(70):  # 2 ms kernels every 10 ms: 80% of gen idle
            kernels.append({"name": "gemv", "t0": t + 0.01 * j, "t1": t + 0.01 * j + 0.002,
                            "comm": False})  # fmt: skip
        kernels.append({"name": "gemm", "t0": t + 0.7, "t1": t + 1.0, "comm": False})
        t += 1.0
    meta = {"rank": 0, "world_size": 1, "device": "H200", "cuda": True, "overhead_s": 0.0}
    data = {"meta": meta, "steps": steps, "phases": phases, "comm": [], "torch_comm": [],
            "kernels": kernels}  # fmt: skip
    m, d = _run(tmp_path, data)
    assert m["gpu_idle"]["share"] == pytest.approx(0.7 * 0.8, abs=0.01)
    assert m["gpu_idle"]["kernel_count"] == 5 * 71
    assert m["gpu_idle"]["top_kernels"][0]["name"] == "gemm"
    sym = d["symptoms"][1]
    assert sym["found"] and "kernel-launch-bound decoding" in sym["likely_causes"][0]
    assert "rollout.use_cuda_graph: true" in sym["remedy"][0]
    # the same profile written without per-kernel data (the default) reports the same
    from verl_comm.profiler.analysis import _comm_intervals, device_summary

    summary = device_summary(kernels, _comm_intervals(data)[0], [(s["t0"], s["t1"]) for s in steps],
                             phases)  # fmt: skip
    m2, d2 = _run(tmp_path, {**data, "kernels": [], "device": summary})
    assert m2["gpu_idle"]["share"] == pytest.approx(m["gpu_idle"]["share"])
    assert d2["found"] == d["found"]


def test_in_step_overhead_baseline_is_the_step_before_profiling():
    from verl_comm.profiler.analysis import _in_step_overhead

    wall = [{"s": 9.0, "profiled": False}, {"s": 5.0, "profiled": False},
            {"s": 1.0, "profiled": False}, {"s": 1.5, "profiled": True},
            {"s": 1.5, "profiled": True}]  # fmt: skip
    o = _in_step_overhead(wall)
    assert o["unprofiled_p50_s"] == 1.0 and o["profiled_p50_s"] == 1.5
    assert o["in_step_slowdown"] == pytest.approx(0.5) and o["unprofiled_steps"] == 1
    assert _in_step_overhead(wall[:1] + wall[3:]) == {}  # only the cold first step before
    assert _in_step_overhead(wall[:1] + wall[3:] + [{"s": 1.2, "profiled": False}]) != {}


def test_idle_gpu_spread_over_update_phases_names_small_kernels(tmp_path):
    steps, phases, kernels = [], [], []
    t = 10.0
    for i in range(5):
        steps.append({"step": i, "t0": t, "t1": t + 1.0})
        for k, name in enumerate(("gen", "update_critic", "update_actor")):
            a = t + k / 3
            phases.append({"name": name, "step": i, "depth": 0, "t0": a, "t1": a + 1 / 3})
            busy = 0.3 if name == "gen" else 0.1  # updates idle 2/3 of their time
            kernels.append({"name": "k", "t0": a, "t1": a + busy, "comm": False})
        t += 1.0
    meta = {"rank": 0, "world_size": 1, "device": "H200", "cuda": True, "overhead_s": 0.0}
    data = {"meta": meta, "steps": steps, "phases": phases, "comm": [], "torch_comm": [],
            "kernels": kernels}  # fmt: skip
    m, d = _run(tmp_path, data)
    sym = d["symptoms"][1]
    assert sym["found"] and sym["likely_causes"][0].startswith("small kernels inside device")
    assert "'update_critic'" in sym["likely_causes"][0] and len(sym["likely_causes"]) == 1
    assert "train.micro_batch_size" in sym["remedy"][0]


def test_step_wall_times_stay_bounded_and_give_the_baseline(tmp_path):
    prof = VerlProfiler(output_dir=tmp_path, steps=[50, 51], torch_profiler=False)
    prof.start()
    for _ in range(200):
        prof.step()
    data = json.loads(prof.stop().read_text())
    assert [w["step"] for w in data["step_wall"]] == [0, 49, 50, 51, 52]
    assert [w["profiled"] for w in data["step_wall"]] == [False, False, True, True, False]


def test_report_cli_rejects_bad_files_thresholds_and_paths(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for bad in ("{}", "[]"):
        (run / "profile_rank0.json").write_text(bad)
        assert profile_main(["report", str(run)]) == 2
        assert "not a profiler JSON" in capsys.readouterr().err
    (run / "profile_rank0.json").write_bytes(b"\xff\xfe\x00")
    assert profile_main(["report", str(run)]) == 2
    assert "profile_rank0.json" in capsys.readouterr().err  # the file is named
    (run / "profile_rank0.json").write_text(json.dumps(_synthetic([1.0] * 5, [0.1] * 5)))
    for args in (["--jitter", "nan"], ["--rollout-p99", "-1"], ["--rollout-p99", "0"]):
        assert profile_main(["report", str(run), *args]) == 2, args
    (tmp_path / "afile").write_text("x")
    assert profile_main(["report", str(run), "--png", str(tmp_path / "afile" / "x.png")]) == 2
    assert "cannot write the report" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "profile_rank0.json").write_text(json.dumps(_synthetic([1.0] * 5, [0.1] * 5)))
    assert profile_main(["report", str(tmp_path), "--png", str(tmp_path / "x.png")]) == 2
    assert "holds 2 runs" in capsys.readouterr().err
    assert profile_main(["report", str(run / "profile_rank0.json")]) == 0  # a file: its run


def test_profiles_of_different_runs_are_not_mixed(tmp_path, capsys):
    a = _synthetic([1.0] * 5, [0.1] * 5)
    b = _synthetic([1.0] * 5, [0.1] * 5)
    a["meta"].update(world_size=2, run_id=1)
    b["meta"].update(world_size=2, run_id=2, rank=1)
    (tmp_path / "profile_rank0.json").write_text(json.dumps(a))
    (tmp_path / "profile_rank1.json").write_text(json.dumps(b))
    assert profile_main(["report", str(tmp_path)]) == 2
    assert "profiles of different runs mixed" in capsys.readouterr().err
    (tmp_path / "profile_rank1.json").unlink()
    m = analyze_run(tmp_path)
    assert m["run"]["missing_ranks"] == [1]
    assert profile_main(["report", str(tmp_path)]) == 0
    assert "MISSING profiles of ranks [1]" in capsys.readouterr().out


def test_unmeasured_communication_is_not_called_fine(tmp_path):
    data = _synthetic([1.0] * 5, [0.1] * 5)
    data["comm"] = []
    data["meta"]["torch_profiler"] = False
    m, d = _run(tmp_path, data)
    assert not m["comm"]["measured"] and m["comm"]["source"].startswith("not measured")
    assert d["symptoms"][2]["found"] is None


def test_stop_survives_an_unwritable_dir_and_never_writes_an_empty_profile(tmp_path):
    prof = VerlProfiler(output_dir=tmp_path / "p", steps=[5], torch_profiler=False)
    prof.start()
    prof.step()
    with pytest.warns(UserWarning, match="no step was profiled"):
        assert prof.stop() is None  # e.g. a resumed run past its profiled steps
    assert not (tmp_path / "p").exists()
    prof = VerlProfiler(output_dir=tmp_path / "q", steps=[0], torch_profiler=False)
    prof.start()
    prof.step()
    (tmp_path / "q").write_text("now a file")  # the folder cannot be made any more
    with pytest.warns(UserWarning, match="training goes on"):
        assert prof.stop() is None
    with pytest.raises(ValueError, match="output_dir"):
        VerlProfiler(output_dir=tmp_path / "q")  # checked up front when enabled


def test_first_step_numbers_steps_and_export_time_is_not_a_step(tmp_path, monkeypatch):
    prof = VerlProfiler(output_dir=tmp_path, steps=[5, 6])
    slow_export = prof._stop_torch

    def export():
        time.sleep(0.3)
        slow_export()

    monkeypatch.setattr(prof, "_stop_torch", export)
    prof.start(first_step=4)  # e.g. resumed after 3 steps: the next one is the log's step 4
    for _ in range(5):
        with prof.phase("update_actor"):
            time.sleep(0.02)
        prof.step()
    data = json.loads(prof.stop().read_text())
    assert [s["step"] for s in data["steps"]] == [5, 6]
    after = next(w for w in data["step_wall"] if w["step"] == 7)
    assert after["s"] < 0.2  # the 0.3 s export is bookkeeping, not step 7's time
    assert data["meta"]["overhead_s"] >= 0.3
