"""Packed against padded policy updates on a batch whose response lengths spread 16-256.

The actor's update, as the trainer runs it per micro-batch: response log-probs through
``sequence_log_probs`` (padded, sdpa with a mask) or ``packed_log_probs`` (one row per
micro-batch; on CUDA torch's ``varlen_attn``, :mod:`verl_ppo.step.varlen`), the fused LM
head as the job's ``auto`` chooses on CUDA, the token-mean loss, backward, then one fused
AdamW step. Same weights, same micro-batches, same tokens: only the padding differs.

Numerics first: the loss and the gradient norm of both paths in bf16 against the padded
fp32 result (the packed error may not exceed twice the padded one plus a bf16 step).
Then ``--rounds`` rounds, both paths interleaved, CUDA events around each update; tokens/s
counts the valid (prompt + response) tokens of the batch.

    python benchmarks/packing.py                     # Qwen2.5-0.5B shape, 128 sequences
    python benchmarks/packing.py --smoke --out /tmp/x   # CI: tiny model, CPU (dense mask)

Records (``benchmarks/results/packing.jsonl``): ``update_tokens_per_s`` per method (median,
min, max), ``speedup_packed_vs_padded``, ``loss_abs_err`` per method; ``packing.md`` is
generated from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._ppo_workload import SHAPES  # noqa: E402


def build(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A causal LM of ``SHAPES[shape]`` with sdpa attention, random weights drawn after
    ``torch.manual_seed(seed)``, on ``device`` in ``dtype``, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return m.to(device=device, dtype=dtype).train()


def batch(n: int, prompt: int, lo: int, hi: int, vocab: int, device: str, seed: int = 0):
    """``(ids, mask)`` of ``n`` rows: ``prompt`` tokens then a response of ``lo..hi`` tokens
    (uniform), right-padded to ``hi``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, prompt + hi), generator=g)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    mask = (torch.arange(prompt + hi)[None] < (prompt + lens)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def update(model, opt, ids, mask, prompt: int, micro: int, packed: bool, fused: bool) -> float:
    """One update over the batch in micro-batches of ``micro`` rows; returns the loss."""
    from verl_ppo.roles.common import sequence_log_probs
    from verl_ppo.step.packing import packed_log_probs

    fn = packed_log_probs if packed else sequence_log_probs
    resp = mask[:, prompt:].float()
    total, loss_sum = resp.sum(), 0.0
    for s in range(0, ids.shape[0], micro):
        logp = fn(model, ids[s : s + micro], mask[s : s + micro], prompt, fused=fused)[0]
        loss = -(logp * resp[s : s + micro]).sum() / total  # token-mean over the batch
        loss.backward()
        loss_sum += loss.detach()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss_sum)


def numerics(a, ids, mask) -> dict:
    """Loss and grad norm, bf16 packed and padded against fp32 padded (no optimizer step)."""
    exact = build(a.shape, a.device, torch.float32)
    out = {"loss_fp32": update(exact, None, ids, mask, a.prompt, a.micro, False, a.fused)}
    g32 = torch.cat([p.grad.flatten() for p in exact.parameters() if p.grad is not None])
    del exact
    for name, packed in (("padded", False), ("packed", True)):
        m = build(a.shape, a.device, a.dtype)
        out[f"loss_{name}"] = update(m, None, ids, mask, a.prompt, a.micro, packed, a.fused)
        g = torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])
        out[f"grad_rel_err_{name}"] = float((g - g32).norm() / g32.norm())
        del m
    for name in ("padded", "packed"):
        out[f"loss_abs_err_{name}"] = abs(out[f"loss_{name}"] - out["loss_fp32"])
    step = 2.0**-8 * abs(out["loss_fp32"]) if a.dtype == torch.bfloat16 else 1e-5
    out["ok"] = out["loss_abs_err_packed"] <= 2 * out["loss_abs_err_padded"] + step
    return out


def timed(a, ids, mask) -> dict[str, list[float]]:
    """Seconds per update of each method (``padded``, ``packed``), ``a.rounds`` rounds after
    ``a.warmup``, the order alternating per round; CUDA synchronised around each update."""
    model = build(a.shape, a.device, a.dtype)
    cuda = a.device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=cuda)
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for r in range(a.warmup + a.rounds):
        for name in ("padded", "packed") if r % 2 == 0 else ("packed", "padded"):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            update(model, opt, ids, mask, a.prompt, a.micro, name == "packed", a.fused)
            if cuda:
                torch.cuda.synchronize()
            if r >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    """CLI: numerics check, interleaved timing, records and markdown; returns 1 when the
    packed loss is outside bf16 noise of the padded one (no timing then), else 0."""
    from verl_comm.bench.env import commit, dirty, now_iso, versions

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen05b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=128, help="sequences per update")
    p.add_argument(
        "--micro", type=int, default=64, help="sequences per micro-batch (configs/gpu.yaml: 64)"
    )
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--min-response", type=int, default=16)
    p.add_argument("--max-response", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny model, few rows, CPU allowed")
    a = p.parse_args(argv)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    a.fused = a.device == "cuda"  # train.fused_log_probs: auto = on CUDA
    stem = "packing"
    if a.smoke:
        a.shape, a.batch, a.micro, a.rounds, a.warmup = "tiny", 8, 4, 2, 1
        a.prompt, a.min_response, a.max_response, stem = 8, 2, 16, "packing.smoke"
    vocab = SHAPES[a.shape]["vocab_size"]
    ids, mask = batch(a.batch, a.prompt, a.min_response, a.max_response, vocab, a.device)
    num = numerics(a, ids, mask)
    print(json.dumps(num))
    if not num["ok"]:
        print("numerics check failed: packed loss outside bf16 noise of padded", file=sys.stderr)
        return 1
    times = timed(a, ids, mask)
    tokens = int(mask.sum())
    meta = {
        "benchmark": "packing",
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "run_id": uuid.uuid4().hex[:12],
        "shape": a.shape,
        "batch": a.batch,
        "micro_batch": a.micro,
        "prompt_tokens": a.prompt,
        "response_tokens": [a.min_response, a.max_response],
        "valid_tokens": tokens,
        "padded_tokens": int(mask.numel()),
        "dtype": str(a.dtype).removeprefix("torch."),
        "fused_log_probs": a.fused,
        "attention": "varlen_attn" if a.device == "cuda" else "dense block-diagonal mask",
        "rounds": a.rounds,
    }
    recs = []
    for name, ts in times.items():
        rates = [tokens / t for t in ts]
        recs.append(
            {
                **meta,
                "metric": "update_tokens_per_s",
                "method": name,
                "value": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
                "unit": "tokens/s",
            }
        )
        recs.append(
            {
                **meta,
                "metric": "loss_abs_err",
                "method": name,
                "value": num[f"loss_abs_err_{name}"],
                "grad_rel_err": num[f"grad_rel_err_{name}"],
                "loss_fp32": num["loss_fp32"],
                "unit": "nats",
            }
        )
    speed = statistics.median(times["padded"]) / statistics.median(times["packed"])
    recs.append({**meta, "metric": "speedup_packed_vs_padded", "value": speed, "unit": "x"})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    write_md(out, stem, meta["run_id"])
    print(f"packed {speed:.2f}x padded ({tokens} valid of {mask.numel()} tokens)")
    return 0


def write_md(out: Path, stem: str, run_id: str) -> None:
    """``<stem>.md`` from every run in ``<stem>.jsonl`` (one row per run; ``run_id`` the newest)."""
    recs = [json.loads(x) for x in (out / f"{stem}.jsonl").read_text().splitlines() if x]
    runs: dict[str, dict] = {}
    for r in recs:
        runs.setdefault(r["run_id"], {})[(r["metric"], r.get("method"))] = r
    m = next(iter(runs[run_id].values()))
    lines = [
        f"# packing: packed vs padded policy update ({m['shape']})",
        "",
        f"{m['batch']} sequences of {m['prompt_tokens']} prompt + {m['response_tokens'][0]}-"
        f"{m['response_tokens'][1]} response tokens ({m['valid_tokens']} valid of "
        f"{m['padded_tokens']} padded, so packing can gain at most "
        f"{m['padded_tokens'] / m['valid_tokens']:.2f}x), {m['dtype']}, fused LM head "
        f"{m['fused_log_probs']}; one update = forward + backward per micro-batch + one fused "
        f"AdamW step, median of {m['rounds']} interleaved rounds (min-max). Loss errors are "
        "against the padded fp32 result on the same weights.",
        "",
        "| run_id | commit | device | attention (packed) | micro-batch | padded tokens/s "
        "| packed tokens/s | packed / padded | loss err padded / packed |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for rid, rows in runs.items():
        a, b = rows[("update_tokens_per_s", "padded")], rows[("update_tokens_per_s", "packed")]
        ea, eb = rows[("loss_abs_err", "padded")], rows[("loss_abs_err", "packed")]
        sp = rows[("speedup_packed_vs_padded", None)]["value"]
        lines.append(
            f"| {rid} | {a['commit']} | {a['device']} | {a['attention']} | {a['micro_batch']} "
            f"| {a['value']:.0f} ({a['min']:.0f}-{a['max']:.0f}) "
            f"| {b['value']:.0f} ({b['min']:.0f}-{b['max']:.0f}) | {sp:.2f}x "
            f"| {ea['value']:.1e} / {eb['value']:.1e} |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
