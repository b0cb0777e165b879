"""``benchmarks/ppo_throughput.py``: the CPU smoke run (CI) and its pure helpers."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "ppo_throughput_bench", REPO / "benchmarks" / "ppo_throughput.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


@pytest.mark.timeout(300)
def test_ppo_throughput_smoke(tmp_path):
    check_exit(run_smoke("ppo_throughput.py", tmp_path, timeout=280))
    recs = read_jsonl(tmp_path / "ppo_throughput.jsonl")
    ours = {(r["metric"], r.get("phase")): r for r in recs if r["system"] == "verl_ppo"}
    tps = ours[("tokens_per_s_per_gpu", None)]
    step = ours[("step_time_s", None)]
    assert tps["benchmark"] == "ppo_throughput" and tps["unit"] == "tokens/s/GPU"
    assert tps["numerics_ok"] and tps["device"].startswith("cpu") and tps["commit"] and tps["date"]
    assert {"torch", "transformers", "deepspeed"} <= set(tps["versions"])
    assert tps["tokens_per_step"] == 4 * (16 + 8) and tps["timed_steps"] == 1
    # tokens/s/GPU is exactly batch x (prompt + response) / median step / world
    assert tps["value"] == pytest.approx(tps["tokens_per_step"] / step["value"])
    phases = {k[1]: r["value"] for k, r in ours.items() if k[0] == "phase_time_s"}
    # one epoch, one mini-batch: the old-log-prob forward is bypassed by default
    assert {"gen", "ref", "values", "update_critic", "update_actor"} <= set(phases)
    assert "old_log_prob" not in phases
    assert len({r["run_id"] for r in recs if r["metric"] != "speedup_vs_trl"}) == 1
    assert tps["world_size"] == 1 and tps["variant"] == "default"
    num = tps["numerics"]  # first-step log-probs against a plain HF forward, real bound
    assert num["ok"] and num["rollout_vs_hf"] < num["bound"] and num["actor_vs_hf"] < num["bound"]
    assert tps["fast_path"]["algorithm.old_log_prob"].startswith("bypass")
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= step["value"] * 1.01
    trl = [r for r in recs if r["system"] == "trl_ppo"]
    if importlib.util.find_spec("trl") is None:
        assert [r["metric"] for r in trl] == ["skipped"] and "trl" in trl[0]["reason"]
    else:
        assert {r["metric"] for r in trl} >= {"tokens_per_s_per_gpu", "phase_time_s"}
    md = (tmp_path / "ppo_throughput.md").read_text()
    assert "| verl_ppo | default |" in md and "tokens/s/GPU" in md


def test_fixed_length_prompts_are_exact_and_task_scores():
    from types import SimpleNamespace

    from verl_ppo.workers.models import load_tokenizer

    tok = load_tokenizer(SimpleNamespace(path=None))
    texts = bench.fixed_length_prompts(tok, 3, 37, seed=1)
    lengths = [len(tok(t, add_special_tokens=False).input_ids) for t in texts]
    assert lengths == [37, 37, 37] and len(set(texts)) == 3
    enc = tok(texts, return_tensors="pt", padding="max_length", max_length=37,
              add_special_tokens=False)  # fmt: skip
    assert bool(enc.attention_mask.all())  # no padding needed: the trainer sees 37 real tokens
    task = bench.FixedLengthTask(texts)
    s = task.sample(tok, "train", 4)
    assert s.prompt == texts[1] and s.entry["question"] == texts[1]
    assert task.score(f"x {s.entry['answer']} y", s.entry) == 1.0
    assert task.score("x" + s.entry["answer"], s.entry) == 0.0


def test_import_stand_ins_only_for_unimportable_modules(tmp_path, monkeypatch):
    missing, broken = "verl_bench_absent_pkg", "verl_bench_broken_pkg"
    (tmp_path / broken).mkdir()
    (tmp_path / broken / "__init__.py").write_text("import verl_bench_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = list(sys.meta_path)
    try:
        assert bench.install_import_stand_ins((missing, broken, "json")) == sorted(
            [missing, broken]
        )
        mod = importlib.import_module(f"{missing}.sub.deeper")
        cls = mod.Anything
        assert isinstance(cls, type) and not isinstance(object(), cls)
        with pytest.raises(ImportError, match="stand-in"):
            cls()
        assert importlib.import_module(broken).X.__name__ == "X"  # broken install replaced
        assert importlib.import_module("json") is json  # importable: never stood in
    finally:
        sys.meta_path[:] = saved
        for name in [m for m in sys.modules if m.split(".")[0] in (missing, broken)]:
            del sys.modules[name]


def _rec(system, metric, value, phase=None):
    r = {"benchmark": "ppo_throughput", "system": system, "metric": metric, "value": value,
         "unit": "x", "device": "2 x H200", "versions": {"trl": "1.12.0"}, "date": "d",
         "commit": "c", "variant": "default", "shape": "qwen05b", "prompt_len": 256,
         "response_len": 256, "rollout_batch": 128, "micro_batch": 8, "timed_steps": 3,
         "warmup_steps": 1, "trl_stand_ins": ["pandas"]}  # fmt: skip
    if phase:
        r["phase"] = phase
    return r


@pytest.mark.parametrize("ours,met", [(3100.0, True), (2900.0, False)])
def test_report_speedup_against_target(tmp_path, ours, met):
    recs = [
        _rec("verl_ppo", "tokens_per_s_per_gpu", 9999.0),  # superseded by the later record
        _rec("verl_ppo", "tokens_per_s_per_gpu", ours),
        _rec("verl_ppo", "step_time_s", 1.0),
        _rec("verl_ppo", "phase_time_s", 0.5, "gen"),
        _rec("trl_ppo", "tokens_per_s_per_gpu", 1000.0),
        _rec("trl_ppo", "step_time_s", 2.0),
    ]
    bench.append_records(tmp_path, recs)
    speed = bench.write_report(tmp_path)
    assert speed["value"] == pytest.approx(ours / 1000.0) and speed["met"] is met
    last = json.loads((tmp_path / "ppo_throughput.jsonl").read_text().splitlines()[-1])
    assert last["metric"] == "speedup_vs_trl" and last["target"] == 3.0
    md = (tmp_path / "ppo_throughput.md").read_text()
    assert ("-> met" in md) is met and "gen 0.5" in md and "stand-ins for pandas" in md
    # writing the report again (e.g. after another system of the run) adds no duplicate
    bench.write_report(tmp_path)
    lines = (tmp_path / "ppo_throughput.jsonl").read_text().splitlines()
    assert sum(json.loads(x)["metric"] == "speedup_vs_trl" for x in lines) == 1


def test_report_claims_against_tuned_trl_and_states_micro_batches(tmp_path):
    tuned = {**_rec("trl_ppo", "tokens_per_s_per_gpu", 2000.0), "variant": "tuned"}
    tuned.update(effective_micro_batch=32, micro_batch_tokens=32 * 512, token_budget=None)
    ours = _rec("verl_ppo", "tokens_per_s_per_gpu", 6000.0)
    ours.update(effective_micro_batch=99, micro_batch_tokens=50688, token_budget=50688)
    steps = [_rec(x, "step_time_s", 1.0) for x in ("verl_ppo", "trl_ppo")]
    steps.append({**_rec("trl_ppo", "step_time_s", 1.0), "variant": "tuned"})
    recs = [ours, _rec("trl_ppo", "tokens_per_s_per_gpu", 1000.0), tuned, *steps]
    bench.append_records(tmp_path, recs)
    speed = bench.write_report(tmp_path)
    assert speed["trl_variant"] == "tuned" and speed["value"] == pytest.approx(3.0)
    md = (tmp_path / "ppo_throughput.md").read_text()
    assert "| 99 / 50688 (token budget) |" in md and "| 32 / 16384 |" in md
    assert "TRL (tuned)" in md


def test_report_gives_each_workload_of_a_run_its_own_section_and_floor(tmp_path):
    """benchmarks/gpu/ppo_shapes.sh: two shapes in one run; a floor record without a shape
    (older records) belongs to the launch that wrote it (same date)."""
    recs = []
    for shape, date, ours, floor in (("deep", "d1", 1000.0, 4000.0), ("wide", "d2", 900.0, 1800.0)):
        run = {**_rec("verl_ppo", "tokens_per_s_per_gpu", ours), "shape": shape, "date": date}
        step = {**_rec("verl_ppo", "step_time_s", 1.0), "shape": shape, "date": date}
        fl = {**_rec("floor", "tokens_per_s_per_gpu", floor), "date": date}
        fl.update(variant="model shape at 100% of peak", step_s=1.0, model_flops_s=0.5)
        fl.update(gen_floor_s=0.5)
        for k in ("shape", "prompt_len", "response_len"):
            del fl[k]
        recs += [run, step, fl]
    bench.append_records(tmp_path, recs)
    bench.write_report(tmp_path)
    md = (tmp_path / "ppo_throughput.md").read_text()
    deep, wide = md.split("## wide")
    assert "## deep, prompt 256 + response 256 tokens" in deep
    assert "| 25% |" in deep and "| 50% |" in wide  # 1000 / 4000 and 900 / 1800


def test_micro_batch_fields_as_run():
    from _ppo_records import _micro_batch_fields

    s = bench.Setup(prompt_len=256, response_len=256, micro_batch=8, trl_micro_batch=32)
    trl = _micro_batch_fields("trl_ppo", s, None)
    assert trl["effective_micro_batch"] == 32 and trl["micro_batch_tokens"] == 32 * 512
    ours = _micro_batch_fields("verl_ppo", s, 50688)  # the auto token budget of issue 30
    assert ours["effective_micro_batch"] == 99 and ours["token_budget"] == 50688
    assert _micro_batch_fields("verl_ppo", s, None)["effective_micro_batch"] == 8
