"""Where the async mode's ranks compute and which backend bridges them
(:func:`verl_ppo.asyncrl.world.placement`), and the host staging of CUDA tensors on a gloo
bridge (GPU only)."""

import time

import pytest
import torch

from verl_ppo.asyncrl.world import placement
from verl_ppo.errors import ConfigError


def test_gloo_has_no_gpu():
    assert placement("gloo", 3, 3, 2, 2, 0) == (None, "gloo")


def test_enough_gpus_each_rank_its_own_over_nccl():
    assert [placement("nccl", r, r, 2, 2, 4) for r in range(4)] == [
        (0, "nccl"), (1, "nccl"), (2, "nccl"), (3, "nccl"),
    ]  # fmt: skip


def test_one_gpu_shared_by_a_training_and_a_rollout_rank_over_gloo():
    assert placement("nccl", 0, 0, 1, 1, 1) == (0, "gloo")
    assert placement("nccl", 1, 1, 1, 1, 1) == (0, "gloo")
    # 2 + 2 on 2 GPUs: training rank i and rollout rank i share GPU i
    assert [placement("nccl", r, r, 2, 2, 2)[0] for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("t, r", [(2, 1), (1, 2)])
def test_a_role_larger_than_the_gpus_is_refused_naming_the_keys(t, r):
    with pytest.raises(ConfigError, match=r"comm.nproc=.*rollout.n_ranks="):
        placement("nccl", 0, 0, t, r, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_cross_a_gloo_group_through_host_memory():
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist

    from verl_ppo.reshard.group_sync import SyncStats, _Peer

    store = dist.HashStore()
    with ThreadPoolExecutor(2) as ex:  # two ranks of one gloo group, one thread each
        groups = list(
            ex.map(lambda r: dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)), (0, 1))
        )
    sender, receiver = _Peer(groups[0], 0, cuda=True), _Peer(groups[1], 1, cuda=True)
    assert sender.stage and not sender.cuda  # gloo work: waited with a timeout, not polled
    src = torch.arange(6, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros_like(src)
    st = SyncStats(0, "full")
    rw = receiver.irecv(dst, 0, st)
    sw = sender.isend(src, 1, st)
    receiver.wait(rw, time.monotonic() + 30, 0, "receive")
    sender.wait(sw, time.monotonic() + 30, 1, "send")
    assert torch.equal(dst, src)  # bit-exact: a copy, no arithmetic
