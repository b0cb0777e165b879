"""One sampler, one loop: the eager HF, static-cache (CUDA graph on GPU) and TP rollout paths
draw the same tokens for the same seed and logits, and report the log-probs the actor's
forward computes."""

from __future__ import annotations

import pytest
import torch

from tests._models import left_padded_prompts, tiny_causal_lm
from verl_ppo.roles.common import sequence_log_probs
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder, tp_model_of
from verl_ppo.rollout.generate import HFGenerator
from verl_ppo.rollout.sampler import SamplingParams, sample_next
from verl_ppo.rollout.tp_generate import TPRolloutModel

CUDA = torch.cuda.is_available()


# initializer_range 0.3: well-separated logits, kernels that differ in rounding agree
MODEL = dict(model_type="qwen2", vocab_size=61, initializer_range=0.3, train=False)
PROMPTS = dict(seed=4, shape=(4, 7), vocab=(1, 61), pads={0: 3, 3: 1})


def _paths(m, graph: bool):
    tp = TPRolloutModel(tp_model_of(m))
    return {
        "hf_eager": HFGenerator(m),
        "static": StaticCacheDecoder(m, 32, use_cuda_graph=False),
        "static_graph": StaticCacheDecoder(m, 32, use_cuda_graph=True) if graph else None,
        "tp1": tp,
    }


def _run(paths, ids, mask, params, seed, dev, eos=-1):
    out = {}
    for name, gen in paths.items():
        if gen is None:
            continue
        out[name] = gen.rollout(
            ids,
            mask,
            max_new_tokens=9,
            eos_token_id=eos,
            pad_token_id=0,
            params=params,
            generator=torch.Generator(dev).manual_seed(seed),
        )
    return out


def test_sample_next_same_seed_same_logits_same_tokens():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(True, 0.7, 50, 0.9)
    a = sample_next(logits, p, torch.Generator().manual_seed(1))
    b = sample_next(logits.clone(), p, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, a[0][:, None]).squeeze(-1)
    torch.testing.assert_close(a[1], ref)
    greedy, _ = sample_next(logits, SamplingParams(do_sample=False))
    assert torch.equal(greedy, logits.argmax(-1))


@pytest.mark.parametrize(
    "params", [SamplingParams(False), SamplingParams(True, 1.0), SamplingParams(True, 0.8, 20, 0.9)]
)
def test_all_paths_same_tokens_and_log_probs_cpu(params):
    m = tiny_causal_lm(**MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    outs = _run(_paths(m, graph=False), ids, mask, params, seed=3, dev="cpu")
    ref = outs["hf_eager"]
    for name, o in outs.items():
        assert torch.equal(o.sequences, ref.sequences), name
        torch.testing.assert_close(o.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5, msg=name)
    # the rollout's log-probs are what the actor's forward computes (bypass mode)
    full = torch.cat([mask, torch.ones_like(ref.log_probs, dtype=torch.long)], 1)  # no EOS
    lp, _ = sequence_log_probs(m, ref.sequences, full, 7, params.temperature)
    torch.testing.assert_close(ref.log_probs, lp, rtol=1e-5, atol=1e-5)


def test_eos_stops_every_path_alike():
    m = tiny_causal_lm(**MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    free = _run(_paths(m, False), ids, mask, SamplingParams(False), 0, "cpu")["hf_eager"]
    eos = int(free.sequences[1, 7 + 2])
    outs = _run(_paths(m, False), ids, mask, SamplingParams(False), 0, "cpu", eos=eos)
    ref = outs["hf_eager"].sequences
    for name, o in outs.items():
        assert torch.equal(o.sequences, ref), name
        is_eos = (ref[:, 7:] == eos).long()
        after = (is_eos.cumsum(-1) - is_eos) > 0  # strictly after the first EOS
        assert after.any() and (o.log_probs[after] == 0).all() and (o.log_probs[~after] < 0).all()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_paths_same_tokens_on_gpu_graph_included(dtype):
    m = tiny_causal_lm(**MODEL).to("cuda", dtype)
    ids, mask = left_padded_prompts(**PROMPTS, device="cuda")
    paths = _paths(m, graph=True)
    paths["tp1_graph"] = None
    for params in (SamplingParams(False), SamplingParams(True, 0.9, 0, 0.95)):
        outs = _run(paths, ids, mask, params, seed=11, dev="cuda")
        tp = TPRolloutModel(tp_model_of(m))
        outs["tp1_graph"] = tp.rollout(
            ids,
            mask,
            max_new_tokens=9,
            eos_token_id=-1,
            pad_token_id=0,
            params=params,
            generator=torch.Generator("cuda").manual_seed(11),
            use_cuda_graph=True,
        )
        assert tp.decoder.use_cuda_graph and tp.decoder.captures == 1
        # graph vs eager over the same functional model: bit-identical
        assert torch.equal(outs["static_graph"].sequences, outs["static"].sequences)
        assert torch.equal(outs["tp1_graph"].sequences, outs["static"].sequences)
        if dtype == torch.float32:  # HF's own forward agrees to rounding: same tokens
            assert torch.equal(outs["hf_eager"].sequences, outs["static"].sequences)
