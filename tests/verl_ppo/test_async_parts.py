"""Parts of the async mode on their own: the world split and the experience channel over
real gloo process groups (a dead rollout rank is named with the phase), and the staleness
check of the training side."""

from types import SimpleNamespace

import pytest
import torch

from verl_comm.distributed.launch import spawn
from verl_ppo.asyncrl.channel import RolloutLinkError
from verl_ppo.asyncrl.train_side import AsyncExperience, StalenessError
from verl_ppo.asyncrl.world import AsyncWorld
from verl_ppo.observe.metrics import PhaseTimer
from verl_ppo.step.experience import Experience


def _cfg(n_train, n_rollout, timeout_s):
    return SimpleNamespace(
        comm=SimpleNamespace(nproc=n_train, timeout_s=timeout_s, backend="gloo"),
        rollout=SimpleNamespace(n_ranks=n_rollout),
    )


def _exp(B=2, P=3, R=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (B, P + R), generator=g)
    return Experience(
        input_ids=ids,
        attention_mask=torch.ones(B, P + R, dtype=torch.long),
        prompt_len=P,
        responses=ids[:, P:],
        response_mask=torch.ones(B, R),
        group_index=torch.arange(B) + 10 * seed,
        scores=torch.rand(B, generator=g),
        rollout_log_prob=-torch.rand(B, R, generator=g),
    )


def worker_channel(rank, world):
    """2 training + 1 rollout rank: both worlds work, batches arrive intact; then the
    rollout rank dies before step 1 and the training ranks name it and the phase."""
    from verl_ppo.asyncrl.channel import ExperienceChannel
    from verl_ppo.asyncrl.world import join_world

    aw = join_world(_cfg(2, 1, 20.0))
    ch = ExperienceChannel(aw.experience, aw.rank, torch.device("cpu"), 20.0)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # the role world: 2 training ranks, or the rollout alone
    if aw.is_rollout:
        assert aw.served_by(aw.rank) == [0, 1] and t.item() == 1.0
        for r in (0, 1):
            ch.send(r, 0, 0, _exp(seed=r), {"async/sync_pause_s": 0.25})
        ch.finish()
        return "rollout"  # its process ends without sending step 1: the peer is gone
    assert t.item() == 2.0 and aw.server_of(aw.rank) == 2
    want = _exp(seed=aw.rank)
    got, version, stats = ch.recv(2, 0, (["e"] * 2, want.group_index))
    assert version == 0 and stats == {
        "async/rollout_gen_s": 0.0,
        "async/sync_pause_s": 0.25,
        "async/sync_transfer_s": 0.0,
    }
    for k in ("input_ids", "attention_mask", "response_mask", "scores", "rollout_log_prob"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k  # bit-exact copy
    try:
        ch.recv(2, 1, (["e"] * 2, want.group_index))
    except RolloutLinkError as e:
        return str(e)
    return "no error"


def test_channel_and_dead_rollout_rank_named():
    msgs = spawn(f"{__file__}:worker_channel", 3, backend=None, timeout_s=60)
    for r, msg in enumerate(msgs[:2]):
        assert f"rank {r}: experience receive (header of step 1) from rollout rank 2" in msg, msg


def _world():
    store = torch.distributed.HashStore()
    return AsyncWorld(0, 2, 2, store=store, weights=None, experience=None, cuda=False, timeout_s=1)


class _Channel:
    def __init__(self, version):
        self.version = version

    def recv(self, src, step, prompts):
        return _exp(), self.version, {}


class _Local:
    def prompts(self, step):
        return [], [], torch.arange(2)


class _Publisher:
    def publish(self, params):
        return {"async/sync_bytes_sent": 1.0}


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_staleness_counter_and_bound(max_staleness):
    ae = AsyncExperience(_world(), _Local(), _Publisher(), dict, max_staleness, torch.device("cpu"))
    ae.begin(3)
    assert ae.world.start_step() == 3  # what the rollout ranks read
    for step in range(3, 7):
        ae.channel = _Channel(max(step - max_staleness, 3))
        _, m = ae.make_experience(step, PhaseTimer())
        assert m["async/staleness_max"] == min(max_staleness, step - 3)
    ae.channel = _Channel(6 - max_staleness - 1)  # one step too old
    with pytest.raises(StalenessError, match=rf"staleness {max_staleness + 1} outside"):
        ae.make_experience(6, PhaseTimer())
    ae.channel = _Channel(7)  # newer than the trained weights
    with pytest.raises(StalenessError, match="staleness -1"):
        ae.make_experience(6, PhaseTimer())
