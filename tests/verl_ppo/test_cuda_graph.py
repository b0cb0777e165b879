"""Static-KV-cache decoder (CUDA-graph rollout): same tokens as generate.py.

The CPU tests run the static-cache path with the graph off (the same functional step the
graph captures); the graph tests need CUDA and are skipped without it.
"""

from __future__ import annotations

import pytest
import torch

from tests._models import left_padded_prompts, tiny_causal_lm
from tests.verl_ppo._decoders import assert_decoders_match_generate
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder, decoder_for
from verl_ppo.rollout.generate import generate

pytestmark = pytest.mark.timeout(120)
CUDA = torch.cuda.is_available()


# initializer_range 0.3: well-separated logits, kernels that differ in rounding agree
MODEL = dict(head_dim=8, initializer_range=0.3, train=False)
PROMPTS = dict(seed=3, shape=(3, 6), vocab=(1, 50), pads={0: 2, 2: 1})


def _both(m, dec, ids, mask, sample: bool, eos: int, n: int = 10):
    kw = dict(max_new_tokens=n, eos_token_id=eos, pad_token_id=0, do_sample=sample)
    dev = ids.device
    a = generate(m, ids, mask, generator=torch.Generator(dev).manual_seed(5), **kw)
    b = dec.generate(ids, mask, generator=torch.Generator(dev).manual_seed(5), **kw)
    return a, b


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_static_cache_matches_generate_greedy_and_sampled(model_type):
    m = tiny_causal_lm(model_type, **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    for sample in (False, True):
        a, b = _both(m, dec, ids, mask, sample, eos=-1)
        assert a.shape == b.shape == (3, 16)
        assert torch.equal(a, b)


def test_prefill_and_decode_logits_match_hf_forward():
    m = tiny_causal_lm("qwen2", **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=12, use_cuda_graph=False)
    out = [dec.prefill(ids, mask)]
    pos = (mask.cumsum(-1) - 1)[:, -1] + 1
    toks = torch.tensor([[7, 8, 9]] * 3)
    for i in range(3):
        out.append(dec.decode(toks[:, i], pos + i, 6 + i))
    seq = torch.cat([ids, toks], 1)
    full = torch.cat([mask, torch.ones_like(toks)], 1)
    ref = m(
        input_ids=seq, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp_min(0)
    ).logits[:, 5:]
    torch.testing.assert_close(torch.stack(out, 1), ref, rtol=1e-5, atol=1e-5)


def test_eos_stop_and_padding_match_generate():
    m = tiny_causal_lm("llama", **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    free, _ = _both(m, dec, ids, mask, False, eos=-1)
    # make EOS the token row 0 emits at step 2: row 0 stops early, others continue
    eos = int(free[0, 6 + 2])
    for sync_every in (1, 4):
        a = generate(
            m, ids, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0, do_sample=False
        )
        b = dec.generate(
            ids,
            mask,
            max_new_tokens=10,
            eos_token_id=eos,
            pad_token_id=0,
            do_sample=False,
            sync_every=sync_every,
        )
        assert torch.equal(a, b)
        assert (b[0, 6 + 3 :] == 0).all()
    # every row stops early: a token each row emits; trimmed where the last one finished
    resp = free[:, 6:]
    common = set(resp[0].tolist()).intersection(*(set(r.tolist()) for r in resp[1:]))
    assert common, "fixture: no token shared by all rows"
    eos_all = min(common, key=lambda t: max(int((r == t).nonzero()[0]) for r in resp))
    kw = dict(max_new_tokens=10, eos_token_id=eos_all, pad_token_id=0, do_sample=False)
    a = generate(m, ids, mask, **kw)
    b = dec.generate(ids, mask, sync_every=8, **kw)
    assert torch.equal(a, b) and b.shape[1] < 16


def test_errors_are_clear():
    m = tiny_causal_lm("llama", **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=8, use_cuda_graph=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        dec.generate(ids, mask, max_new_tokens=5, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="prompt_len"):
        dec.generate(ids, mask[:, 1:], max_new_tokens=1, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="use_cuda_graph=false"):
        StaticCacheDecoder(tiny_causal_lm("qwen3", **MODEL), max_seq_len=8, use_cuda_graph=False)
    if not CUDA:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            StaticCacheDecoder(m, max_seq_len=8, use_cuda_graph=True)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_matches_eager_static_and_generate():
    m = tiny_causal_lm("qwen2", **MODEL).to("cuda")
    ids, mask = left_padded_prompts(**PROMPTS, device="cuda")
    eager = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    graph = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=True)
    assert_decoders_match_generate(m, {"eager": eager, "graph": graph}, ids, mask, 10)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_recaptures_when_parameters_move():
    m = tiny_causal_lm("llama", **MODEL).to("cuda")
    ids, mask = left_padded_prompts(**PROMPTS, device="cuda")
    graph = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=True)
    kw = dict(max_new_tokens=6, eos_token_id=-1, pad_token_id=0, do_sample=False)
    graph.generate(ids, mask, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data * 1.5  # new storage
    assert torch.equal(graph.generate(ids, mask, **kw), generate(m, ids, mask, **kw))


def test_decoder_for_reuses_until_it_outgrows():
    m = tiny_causal_lm("llama", **MODEL)
    d1 = decoder_for(None, m, prompt_len=6, max_new_tokens=10, use_cuda_graph=False)
    assert d1.max_seq_len == 64
    assert decoder_for(d1, m, 40, 24, False) is d1
    d2 = decoder_for(d1, m, 40, 25, False)
    assert d2 is not d1 and d2.max_seq_len == 128
    assert (
        decoder_for(d2, tiny_causal_lm("llama", **MODEL), 6, 10, False) is not d2
    )  # another model
