"""The step line's compression field, the summary line and the never-compressed notice."""

from verl_ppo.observe.metrics import format_line
from verl_ppo.observe.report import RunSummary, Sample, comm_part, format_samples


def _step(ratio_actor, ratio_critic=None, **extra):
    m = {"reward/mean": 0.5, "perf/tokens": 1000.0, "timing_s/step": 2.0, **extra}
    m["comm/actor/compression_ratio"] = ratio_actor
    if ratio_critic is not None:
        m["comm/critic/compression_ratio"] = ratio_critic
    return m


def test_step_line_shows_method_and_ratio_per_role():
    assert comm_part(_step(3.88, 3.9), "int8") == "comm int8 actor 3.88x critic 3.90x"
    assert comm_part(_step(1.0), "int8") == "comm int8 actor off"
    assert comm_part({}, "none") == "comm none"
    line = format_line(2, _step(3.88), comm_method="int8")
    assert "| comm int8 actor 3.88x" in line and line.startswith("step 2 | reward 0.5")
    assert "comm" not in format_line(0, {"eval/reward": 0.4}, comm_method="int8")


def test_summary_line_and_notice_when_compression_never_turned_on():
    s = RunSummary("int8", start_iter=1, world_size=2, eval_start=0.25)
    s.observe(_step(1.0, 1.0))
    s.eval_end = 0.5
    assert s.line(61.2) == (
        "done | eval 0.250 -> 0.500 (+0.250) | 1 steps, wall 61 s | 500 tokens/s "
        "| comm int8 never on"
    )
    assert "never turned on: it starts at gradient reduction compression.start_iter=1" in (
        s.never_compressed()
    )
    s.observe(_step(3.88, 3.88))
    assert s.never_compressed() is None and s.line(1.0).endswith("actor 3.88x critic 3.88x")
    one = RunSummary("int8", 1, world_size=1)
    one.observe(_step(1.0))
    assert "the world size is 1" in one.never_compressed()
    none = RunSummary("none", 1, 2)
    none.observe({"reward/mean": 0.0})
    assert none.never_compressed() is None and none.line(1.0, stopped=2).startswith(
        "stopped (signal 2) | 1 steps"
    )


def test_samples_block():
    text = format_samples("held-out samples at step 0:", [Sample("Calculate 1 + 2.", "3", 1.0)])
    assert text.splitlines() == [
        "held-out samples at step 0:",
        "  #1 [prompt] Calculate 1 + 2.",
        "     [response] '3'",
        "     [reward] 1",
    ]


def test_summary_line_of_a_resumed_run_says_where_and_keeps_the_eval():
    s = RunSummary("none", 0, 2, resumed_at=6, eval_start=0.5, eval_end=0.75)
    s.observe({"perf/tokens": 100.0, "timing_s/step": 1.0})
    assert s.line(10.0).startswith("done | resumed at step 6 | eval 0.500 -> 0.750 (+0.250)")
