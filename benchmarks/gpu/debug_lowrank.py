"""GPU diagnosis of the int8/low-rank hooks (torchrun --nproc_per_node=2): where NaN appears."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from verl_comm.compression.collective import ProcessGroupCollective
from verl_comm.compression.config import CompressionConfig
from verl_comm.compression.lowrank import LowRankBucketState, lowrank_int8_allreduce
from verl_comm.compression.lowrank_plan import plan_lowrank
from verl_comm.hooks import make_hook

dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
rank = dist.get_rank()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
coll = ProcessGroupCollective()
n = 4096
shapes = [(n, n)] * 4 + [(n,)] * 4
plan = plan_lowrank(shapes, 32)
st = LowRankBucketState()
torch.manual_seed(rank)
for it in range(4):
    flat = torch.randn(plan.numel, device=dev) * 1e-3
    res = lowrank_int8_allreduce(
        flat,
        plan,
        st,
        coll,
        residual_dtype=torch.bfloat16,
        generator=torch.Generator().manual_seed(0),
    )
    torch.cuda.synchronize()
    print(
        f"[direct r{rank}] it{it} finite={bool(res.finite)} out_nan={bool(torch.isnan(res.out).any())} "
        f"q_nan={[bool(torch.isnan(q).any()) for q in st.qs]} err/in={float(res.error_sq / res.input_sq):.3g}",
        flush=True,
    )

for method, rank_ in (("int8", None), ("int8", 32)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(n, n) for _ in range(4)]).to(dev)
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=25)
    cfg = CompressionConfig(gradient_compression="int8", compression_rank=rank_, start_iter=2)
    hook, state = make_hook(cfg)
    ddp.register_comm_hook(state, hook)
    x = torch.randn(1024, n, device=dev, generator=torch.Generator(dev).manual_seed(rank))
    for step in range(5):
        ddp.zero_grad(set_to_none=True)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = ddp(x)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            fin = all(torch.isfinite(p.grad).all() for p in model.parameters())
            print(
                f"[ddp {method} r={rank_} rank{rank}] step{step} grads finite={fin} {state.metrics()}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            print(
                f"[ddp {method} r={rank_} rank{rank}] step{step} ERROR {type(e).__name__}: {str(e)[:200]}",
                flush=True,
            )
            break
    del ddp, model
dist.destroy_process_group()
