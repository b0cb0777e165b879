"""Config validation: every error names the field and the fix."""

import pytest

from verl_ppo.config import ConfigError, PPOConfig, build_config, load_config, parse_overrides


def test_defaults_validate_and_derive():
    cfg = PPOConfig()
    d = cfg.derived(2)
    assert d.local_rollout_batch_size == cfg.train.rollout_batch_size // 2
    assert d.grad_accum_steps * d.local_micro_batch_size == d.local_mini_batch_size


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"train\.num_stepz: unknown key"):
        build_config({"train": {"num_stepz": 3}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"train\.num_steps"):
        build_config({"train": {"num_steps": "many"}})


def test_grpo_needs_samples():
    with pytest.raises(ConfigError, match=r"n_samples >= 2"):
        build_config({"algorithm": {"adv_estimator": "grpo", "n_samples": 1}})


def test_batch_not_dividing_ranks():
    cfg = build_config({"train": {"rollout_batch_size": 6, "ppo_mini_batch_size": 6}})
    with pytest.raises(
        ConfigError, match=r"train.rollout_batch_size=6 does not divide evenly by ranks \(4\)"
    ):
        cfg.derived(4)


def test_minibatch_must_divide_rollout():
    with pytest.raises(ConfigError, match="not a multiple of train.ppo_mini_batch_size"):
        build_config({"train": {"rollout_batch_size": 8, "ppo_mini_batch_size": 3}})


def test_kl_in_two_places_rejected():
    with pytest.raises(ConfigError, match="choose one place"):
        build_config({"algorithm": {"kl": {"use_kl_in_reward": True, "use_kl_loss": True}}})


def test_top_level_compression_keys_are_lifted():
    cfg = build_config({"gradient_compression": "int8", "compression_rank": 64})
    assert cfg.compression.gradient_compression == "int8"
    assert cfg.compression.compression_rank == 64


def test_keyword_overrides_like_the_python_api():
    cfg = build_config({}, gradient_compression="bf16", **{"train.num_steps": 3})
    assert cfg.compression.gradient_compression == "bf16" and cfg.train.num_steps == 3


def test_hybrid_engine_keys_accepted():
    cfg = build_config({"actor": {"model_config": {"hybrid_engine": {"enable": False}}}})
    assert cfg.actor.model_config_.hybrid_engine.enable is False


def test_not_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(p)


def test_not_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a YAML mapping"):
        load_config(p)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/cfg.yaml")


def test_overrides_parse_yaml_scalars():
    assert parse_overrides(["a.b=3", "c=true", "d=[1, 2]", "e=x"]) == {
        "a": {"b": 3},
        "c": True,
        "d": [1, 2],
        "e": "x",
    }
    with pytest.raises(ConfigError, match="dotted.key=value"):
        parse_overrides(["novalue"])


def test_shipped_configs_validate():
    for name in ("default", "tiny", "long_grpo"):
        load_config(f"configs/{name}.yaml")


def test_unknown_task_named():
    with pytest.raises(ConfigError, match=r"data\.task: .*unknown task 'nope'"):
        build_config({"data": {"task": "nope"}})


def test_profiler_steps_and_output_dir_checked_up_front(tmp_path):
    ok = {"enable": True, "steps": [1, 3], "output_dir": str(tmp_path / "new" / "prof")}
    build_config(
        {"train": {"num_steps": 3}, "profiler": ok}
    )  # numbered as in the log, 1..num_steps
    with pytest.raises(ConfigError, match=r"profiler.steps \[0, 4\] outside 1..train.num_steps=3"):
        build_config({"train": {"num_steps": 3}, "profiler": {**ok, "steps": [0, 2, 4]}})
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="profiler.output_dir: .* is not a folder"):
        build_config({"profiler": {"enable": True, "output_dir": str(afile)}})
    with pytest.raises(ConfigError, match="profiler.output_dir: .* cannot be created"):
        build_config({"profiler": {"enable": True, "output_dir": str(afile / "sub")}})
    build_config({"profiler": {"enable": False, "output_dir": str(afile)}})  # off: not checked


def test_micro_batch_not_dividing_names_the_divisors():
    cfg = build_config({"train": {"micro_batch_size": 3}})  # mini-batch 8 over 2 ranks = 4
    with pytest.raises(
        ConfigError,
        match=r"train.micro_batch_size=3 does not divide the per-rank mini-batch .* = 4\): "
        r"set train.micro_batch_size to one of \[1, 2, 4\], or train.ppo_mini_batch_size "
        r"to a multiple of 6",
    ):
        cfg.derived(2)


def test_ranks_not_dividing_the_batch_name_the_rank_counts():
    cfg = build_config({"comm": {"nproc": 3}})
    with pytest.raises(ConfigError, match=r"run a number of ranks in \[1, 2, 4, 8\] \(comm.nproc"):
        cfg.derived(cfg.comm.nproc)


def test_schema_imports_no_feature_module():
    """``verl_ppo.config`` is the schema: importing it loads only sub-schemas (the rules and
    the resolver load when a config is built)."""
    import ast
    import subprocess
    import sys

    code = (
        "import sys, verl_ppo.config; "
        "print(sorted(m for m in sys.modules if m.startswith('verl_ppo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert loaded <= {
        "verl_ppo",
        "verl_ppo.config",
        "verl_ppo.errors",
        "verl_ppo.job",
        "verl_ppo.job.strict_model",
        "verl_ppo.reshard",
        "verl_ppo.reshard.config",
        "verl_ppo.reshard.layout",
        "verl_ppo.rollout",
        "verl_ppo.rollout.config",
    }, loaded


def test_a_switch_rule_refuses_true_and_turns_auto_off_with_one_reason():
    """ZeRO-3 x fused log-probs is written once (verl_ppo.job.rules.SWITCHES): an explicit true
    is refused when the config is built, auto resolves off with the same reason."""
    from verl_ppo.job.fast_path import ModelFacts, resolve

    why = "ZeRO-3 partitions the LM head weight"
    with pytest.raises(ConfigError, match=f"train.fused_log_probs=true cannot apply: {why}"):
        build_config(None, **{"actor.zero_stage": 3, "train.fused_log_probs": True})
    facts = ModelFacts("LlamaForCausalLM", None, None, 2, "sdpa")
    job = resolve(build_config(None, **{"actor.zero_stage": 3}), False, facts)
    assert not job.fused_log_probs
    assert job.reasons["train.fused_log_probs"] == f"off (auto: {why})"
    assert job.metrics()["auto/train.fused_log_probs"] == 0.0
    with pytest.raises(AttributeError):  # resolved once: read, never re-decided
        job.fused_log_probs = True


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["train.num_step=3"], "  train.num_step: unknown key; did you mean train.num_steps?"),
        (["gradient_compresion=int8"], "  gradient_compresion: unknown key; did you mean "),
        (["actor.model_confg.x=1"], "  actor.model_confg: unknown key; did you mean actor.model_"),
        (["gradient_compression=int4"], "  gradient_compression: Input should be"),
        (["compression.gradient_compression=int4"], "  compression.gradient_compression: "),
    ],
)
def test_errors_name_the_key_as_typed_with_did_you_mean(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", overrides)
    assert line in str(err.value).splitlines()[1], str(err.value)


def test_batch_error_has_no_root_prefix_and_a_fix():
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", ["train.rollout_batch_size=6"])
    msg = str(err.value)
    assert "<root>" not in msg and "Value error" not in msg, msg
    assert "set train.rollout_batch_size=8" in msg
    with pytest.raises(ConfigError, match=r"set train.ppo_mini_batch_size to one of \[1, 2"):
        load_config("configs/default.yaml", ["train.ppo_mini_batch_size=6"])


def test_a_nested_compression_override_wins_over_the_files_top_level_key():
    # configs/default.yaml writes gradient_compression at top level; the override used to
    # be dropped silently
    cfg = load_config("configs/default.yaml", ["compression.gradient_compression=int8"])
    assert cfg.compression.gradient_compression == "int8"
    with pytest.raises(ConfigError, match="gradient_compression is given twice"):
        build_config(
            {"gradient_compression": "int8", "compression": {"gradient_compression": "none"}}
        )
