"""The decode step captured with its draw and bookkeeping (verl_ppo/rollout/graph_loop.py):
the same tokens and log-probs as the shared decode loop.

On the CPU the loop's step runs eagerly (``capture=False``: the code the graph captures,
with the torch sampler); the graph tests need CUDA and are skipped without it.
"""

from __future__ import annotations

import pytest
import torch

from tests._models import left_padded_prompts, tiny_causal_lm
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder
from verl_ppo.rollout.graph_loop import LoopBuffers, graph_rollout
from verl_ppo.rollout.sampler import SamplingParams
from verl_ppo.rollout.tp_generate import TPRolloutModel

pytestmark = pytest.mark.timeout(120)
CUDA = torch.cuda.is_available()
MODEL = dict(head_dim=8, initializer_range=0.3, train=False)
PROMPTS = dict(seed=3, shape=(3, 6), vocab=(1, 50), pads={0: 2, 2: 1})


def _loop(dec: StaticCacheDecoder, ids, mask, capture: bool, **kw):
    """``graph_rollout`` over ``dec``'s own buffers and step (what ``dec.rollout`` does on
    CUDA with the graph on)."""
    B = ids.shape[0]
    bufs = dec._buffers(B)
    lb = dec._loops.setdefault(B, LoopBuffers.new(B, dec.max_seq_len, dec.device))
    return graph_rollout(
        lambda: dec._step(bufs),
        lambda: dec._prefill(bufs, ids, mask),
        (bufs.tok, bufs.pos, bufs.slot),
        lb,
        ids,
        mask,
        param_ptrs=dec.tp_model.param_ptrs(),
        capture=capture,
        **kw,
    )


def _same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.log_probs, b.log_probs)


def _eos_of(seq: torch.Tensor, P: int) -> int:
    """A token row 0 draws at response step 2 (so that row stops early)."""
    return int(seq[0, P + 2])


@pytest.mark.parametrize("params", [SamplingParams(False), SamplingParams(True, 0.8)])
def test_eager_loop_step_equals_decode_loop_cpu(params):
    m = tiny_causal_lm("qwen2", **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    kw = dict(max_new_tokens=10, pad_token_id=0, params=params)
    free = dec.rollout(
        ids, mask, eos_token_id=None, generator=torch.Generator().manual_seed(2), **kw
    )
    for eos in (None, _eos_of(free.sequences, 6)):
        for sync_every in (1, 3):
            want = dec.rollout(
                ids, mask, eos_token_id=eos, generator=torch.Generator().manual_seed(2),
                sync_every=sync_every, **kw,
            )  # fmt: skip
            got = _loop(
                dec, ids, mask, False, eos_token_id=eos, sync_every=sync_every,
                generator=torch.Generator().manual_seed(2), **kw,
            )  # fmt: skip
            _same(got, want)
    # finished rows are padded, their log-probs 0, and steps past every row's EOS trimmed
    eos = _eos_of(free.sequences, 6)
    got = _loop(dec, ids, mask, False, eos_token_id=eos, generator=torch.Generator().manual_seed(2), **kw)  # fmt: skip
    assert (got.sequences[0, 6 + 3 :] == 0).all() and (got.log_probs[0, 3:] == 0).all()


def test_loop_rejects_more_steps_than_its_buffers_cpu():
    m = tiny_causal_lm("llama", **MODEL)
    ids, mask = left_padded_prompts(**PROMPTS)
    dec = StaticCacheDecoder(m, max_seq_len=8, use_cuda_graph=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _loop(dec, ids, mask, False, max_new_tokens=9, eos_token_id=None, pad_token_id=0,
              params=SamplingParams(), generator=None)  # fmt: skip


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_loop_equals_decode_loop_and_the_tp_path(dtype):
    m = tiny_causal_lm("qwen2", **MODEL).to("cuda", dtype)
    ids, mask = left_padded_prompts(**PROMPTS, device="cuda")
    eager = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    graph = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=True)

    def gen():
        return torch.Generator("cuda").manual_seed(4)

    kw = dict(max_new_tokens=10, pad_token_id=0)
    for params in (SamplingParams(False), SamplingParams(True, 0.7)):
        free = eager.rollout(ids, mask, eos_token_id=None, params=params, generator=gen(), **kw)
        for eos in (None, _eos_of(free.sequences, 6)):
            want = eager.rollout(ids, mask, eos_token_id=eos, params=params, generator=gen(), **kw)
            _same(graph.rollout(ids, mask, eos_token_id=eos, params=params, generator=gen(), **kw), want)  # fmt: skip
            tp = TPRolloutModel(graph.tp_model)  # samples through `pick`: the model-step graph
            got = tp.rollout(ids, mask, eos_token_id=eos, params=params, generator=gen(),
                             use_cuda_graph=True, **kw)  # fmt: skip
            assert torch.equal(got.sequences, want.sequences)
    # one capture per (sampling parameters, EOS ids): greedy, sampled, each with and without EOS
    assert graph.captures == 4
    again = graph.rollout(ids, mask, eos_token_id=None, params=SamplingParams(False), **kw)
    assert graph.captures == 4  # kept: greedy evaluation between sampled rollouts replays
    _same(again, eager.rollout(ids, mask, eos_token_id=None, params=SamplingParams(False), **kw))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_captured_loop_recaptures_when_weights_move_and_draws_seeds_once():
    m = tiny_causal_lm("llama", **MODEL).to("cuda")
    ids, mask = left_padded_prompts(**PROMPTS, device="cuda")
    graph = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=True)
    eager = StaticCacheDecoder(m, max_seq_len=20, use_cuda_graph=False)
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, params=SamplingParams())
    g = torch.Generator("cuda").manual_seed(9)
    graph.rollout(ids, mask, generator=g, **kw)
    # the generator advanced by exactly one draw of the seeds, never by the replays
    ref = torch.Generator("cuda").manual_seed(9)
    torch.randint(0, 2**62, (6,), dtype=torch.int64, device="cuda", generator=ref)
    assert g.get_offset() == ref.get_offset()
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data * 1.5  # new storage: the decoders read the same parameters
    a = graph.rollout(ids, mask, generator=torch.Generator("cuda").manual_seed(1), **kw)
    b = eager.rollout(ids, mask, generator=torch.Generator("cuda").manual_seed(1), **kw)
    _same(a, b)
    assert graph.captures == 2
