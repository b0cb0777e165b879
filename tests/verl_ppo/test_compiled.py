"""``train.torch_compile``: regional compilation of the decoder layers (verl_ppo/step/compiled.py).

CPU: which layers are found, the switch's resolution and refusal, and that generation through
the HF model runs the compiled layers eagerly (no compilation, same tokens). CUDA (skipped
without it): the compiled training forward and backward against eager, within bf16 noise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from verl_ppo.step.compiled import (
    CompiledOrEager,
    compile_decoder_layers,
    decoder_layers,
    eager_layers,
    torch_compile_unsupported,
)
from verl_ppo.workers.models import build_value_model


def _tiny(layers: int = 2, dtype=torch.float32) -> torch.nn.Module:
    from tests._models import tiny_causal_lm

    fields = dict(hidden_size=64, intermediate_size=128, vocab_size=256)
    return tiny_causal_lm("llama", num_hidden_layers=layers, **fields).to(dtype)


def test_decoder_layers_of_each_model_kind():
    m = _tiny(3)
    assert decoder_layers(m) == list(m.model.layers)
    assert decoder_layers(m.model) == list(m.model.layers)
    v = build_value_model(m, torch.float32)
    assert decoder_layers(v) == list(v.backbone.layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    assert torch_compile_unsupported(True, torch.nn.Linear(2, 2)) is not None
    assert "CUDA" in torch_compile_unsupported(False, m)
    assert torch_compile_unsupported(True, m) is None


def test_compile_sets_each_layer_and_eager_layers_restores():
    m = _tiny(3)
    assert compile_decoder_layers(m) == 3
    compiled = [layer._compiled_call_impl for layer in m.model.layers]
    assert all(c is not None for c in compiled)
    with eager_layers(m):
        assert all(layer._compiled_call_impl is None for layer in m.model.layers)
    assert [layer._compiled_call_impl for layer in m.model.layers] == compiled


def test_hf_generation_runs_compiled_layers_eagerly():
    from torch._dynamo.utils import counters

    from verl_ppo.rollout.generate import generate

    m = _tiny(2).eval()
    ref = copy.deepcopy(m)
    compile_decoder_layers(m)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=0, do_sample=False)
    before = sum(counters["frames"].values())
    got = generate(m, ids, mask, **kw)
    assert sum(counters["frames"].values()) == before  # nothing went through dynamo
    assert torch.equal(got, generate(ref, ids, mask, **kw))


def test_a_forward_with_a_kv_cache_runs_eagerly():
    """HF builds a DynamicCache when ``use_cache`` is not False: its per-layer state would
    compile each layer once and exhaust the recompile limit (then training runs eager)."""
    from torch._dynamo.utils import counters

    m = _tiny(2).eval()
    ref = copy.deepcopy(m)
    compile_decoder_layers(m)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(2))
    before = sum(counters["frames"].values())
    with torch.no_grad():
        got = m(input_ids=ids, use_cache=True).logits
        want = ref(input_ids=ids, use_cache=True).logits
    assert sum(counters["frames"].values()) == before
    assert torch.equal(got, want)
    assert torch._dynamo.config.recompile_limit >= 32


def test_compiled_or_eager_runs_eagerly_on_cpu():
    calls = []

    def f(x):
        calls.append(1)
        return x * 2

    g = CompiledOrEager(f)
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0))
    assert g.compiled is None and calls == [1]


def test_explicit_true_on_cpu_is_refused_before_start():
    from verl_ppo.config import build_config
    from verl_ppo.job.preflight import PreflightError, check_fast_path

    if torch.cuda.is_available():
        pytest.skip("refusal is for machines without CUDA")
    cfg = build_config(None, **{"train.torch_compile": True})
    with pytest.raises(PreflightError, match="train.torch_compile=true cannot apply"):
        check_fast_path(cfg, _tiny(1).config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_training_step_matches_eager_on_cuda():
    m = _tiny(2, torch.bfloat16).cuda()
    c = copy.deepcopy(m)
    compile_decoder_layers(c)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (3, 5):  # two shapes: the second recompiles with dynamic sizes
        ids = torch.randint(3, 200, (rows, 24), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        losses = []
        for model in (m, c):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
            loss = out.logits.float().logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.allclose(losses[0], losses[1], rtol=2e-2), losses
        for (n, a), (_, b) in zip(m.named_parameters(), c.named_parameters()):
            rel = (a.grad.float() - b.grad.float()).norm() / a.grad.float().norm().clamp_min(1e-8)
            assert rel < 5e-2, (n, float(rel))
    assert all(layer._compiled_call_impl is not None for layer in c.model.layers)


@pytest.mark.parametrize(
    "over, on, reason",
    [
        ({}, True, "on (auto)"),
        ({"actor.zero_stage": 3}, False, "ZeRO-3"),
        ({"critic.zero_stage": 3}, False, "ZeRO-3"),
        ({"model.gradient_checkpointing": True}, False, "gradient_checkpointing"),
        ({"model.gradient_checkpointing": True, "train.torch_compile": True}, True, "on (set)"),
        ({"train.torch_compile": False}, False, "off (set)"),
    ],
)
def test_resolution_on_a_cuda_machine(over, on, reason):
    """What ``auto`` resolves to with CUDA (``resolve`` takes the device as an argument)."""
    from verl_ppo.config import build_config
    from verl_ppo.job.fast_path import resolve

    fp = resolve(build_config(None, **over), True, _tiny(1))
    assert fp.torch_compile is on
    assert reason in fp.reasons["train.torch_compile"]
    assert fp.metrics()["auto/train.torch_compile"] == float(on)


def test_explicit_true_with_zero3_is_refused():
    from verl_ppo.config import ConfigError, build_config
    from verl_ppo.job.fast_path import resolve

    over = {"actor.zero_stage": 3, "train.torch_compile": True}
    with pytest.raises(ConfigError, match="train.torch_compile=true cannot apply: ZeRO-3"):
        build_config(None, **over)  # the rule needs no device: refused when the config is built
    cfg = build_config(None, **{**over, "train.torch_compile": "auto"})
    with pytest.raises(ConfigError, match="train.torch_compile=true cannot apply: ZeRO-3"):
        resolve(
            cfg.model_copy(update={"train": cfg.train.model_copy(update=dict(torch_compile=True))}),
            True,
            _tiny(1),
        )
