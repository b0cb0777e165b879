"""Production-checklist throughput: each item on and off, side by side in one process.

Items measured on a random-weight model of the shape given by flags:

- rollout (``rollout.use_cuda_graph``): generated tokens/s of ``generate.py`` (HF eager,
  dynamic KV cache), the static-cache decoder without graphs, and with decode steps
  captured as CUDA graphs (GPU only);
- training forward+backward (sequence packing + token-budget micro-batches): valid
  tokens/s of the padded path (fixed ``--micro-batch-size`` sequences) and of the packed
  path (micro-batches under ``--max-tokens`` = micro-batch size x padded length, i.e. the
  same memory budget).

Protocol: numerics are checked first and the script exits non-zero when they fail
(teacher-forced logits of the static-cache decoder vs the HF forward; graph vs no graph;
packed vs padded log-probs and loss). Then ``--warmup`` untimed rounds, ``--rounds`` timed
rounds with the methods interleaved inside each round; CUDA events bracket each method
(``torch.cuda.synchronize`` before reading), median over rounds. The batch has variable
prompt lengths (U[P/4, P], left-padded) and response lengths (U[R/8, R], EOS disabled so
rollout always generates R tokens).

Single GPU (the lead's command, Qwen2.5-0.5B shape, bf16)::

    python benchmarks/checklist.py --out $OUT --dtype bfloat16 --batch 64 \
        --prompt-len 256 --response-len 256

CPU smoke (CI, < 60 s)::

    python benchmarks/checklist.py --smoke --out /tmp/checklist

Writes ``<out>/checklist.jsonl`` (``"metric": "tokens_per_s"`` per ``item``/``method``)
and ``<out>/checklist.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _ppo_workload (model shapes)

from _ppo_workload import SHAPES  # noqa: E402

from verl_comm.bench.env import dirty  # noqa: E402
from verl_ppo.roles.common import sequence_log_probs  # noqa: E402
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder  # noqa: E402
from verl_ppo.rollout.generate import generate  # noqa: E402
from verl_ppo.step.batching import token_budget_micro_batches  # noqa: E402
from verl_ppo.step.packing import packed_log_probs  # noqa: E402

_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers")
_SHAPE_KEYS += ("num_attention_heads", "num_key_value_heads", "vocab_size")
QWEN05B = {k: SHAPES["qwen05b"][k] for k in _SHAPE_KEYS}
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, < 60 s")
    p.add_argument("--model-type", default="qwen2")
    for k, v in QWEN05B.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8, help="padded path, sequences")
    p.add_argument("--max-tokens", type=int, default=0, help="packed budget; 0 = mbs x L")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="commit id when .git is absent")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
        a.dtype, a.batch, a.prompt_len, a.response_len = "float32", 4, 12, 12
        a.micro_batch_size, a.warmup, a.rounds = 2, 1, 2
    return a


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return r.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Timer:
    """Seconds of a callable: CUDA events on GPU (synchronised), perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def build_model(a: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Random-weight HF causal LM of the flags' shape, in ``--dtype``, eval mode, sdpa."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {k: getattr(a, k) for k in QWEN05B}
    cfg = AutoConfig.for_model(a.model_type, **shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    with device:  # initialise on the device: a 0.5B model inits in seconds on a GPU
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype=dtype).eval()


def make_batch(a: argparse.Namespace, device: torch.device):
    """Prompts ``(B, P)`` left-padded, plus full sequences ``(B, P + R)`` with masks."""
    g = torch.Generator().manual_seed(a.seed)
    B, P, R, V = a.batch, a.prompt_len, a.response_len, a.vocab_size
    ids = torch.randint(1, V, (B, P + R), generator=g)
    plen = torch.randint(max(P // 4, 1), P + 1, (B,), generator=g)
    rlen = torch.randint(max(R // 8, 1), R + 1, (B,), generator=g)
    col = torch.arange(P + R)
    mask = ((col >= P - plen[:, None]) & (col < P + rlen[:, None])).long()
    ids = ids * mask
    return ids[:, :P].to(device), mask[:, :P].to(device), ids.to(device), mask.to(device)


def _hf_logits(model, seq: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(
            input_ids=seq,
            attention_mask=mask,
            position_ids=(mask.long().cumsum(-1) - 1).clamp_min(0),
            use_cache=False,
        )
    return out.logits[:, start:].float()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def check_rollout(model, ref_model, dec, gdec, prompt, pmask, steps: int) -> dict:
    """Teacher-forced logits of the static-cache decoder vs the HF forward.

    The tolerance is relative to the noise floor of the run's dtype: ours (vs the fp32 HF
    forward of ``ref_model``) may err at most 2x as much as HF's own forward in the run's
    dtype, + 1e-4; the graph (``gdec``, optional) replays the same kernels as ``dec`` and
    must agree with it to 1e-3 (relative max error).

    Returns:
        The errors, plus ``"failed": {"static_cache"|"cuda_graph": reason}`` for each
        method that is off bounds (it is then not timed).
    """
    P = prompt.shape[1]
    logits = [dec.prefill(prompt, pmask).float()]
    g_logits = [gdec.prefill(prompt, pmask).float()] if gdec else []
    pos = (pmask.long().cumsum(-1) - 1)[:, -1] + 1
    toks = []
    for i in range(steps):
        t = logits[-1].argmax(-1)
        toks.append(t)
        logits.append(dec.decode(t, pos + i, P + i).float())
        if gdec:
            g_logits.append(gdec.decode(t, pos + i, P + i).float().clone())
    seq = torch.cat([prompt, torch.stack(toks, 1)], 1)
    mask = torch.cat([pmask, torch.ones_like(seq[:, P:])], 1)
    ref32 = _hf_logits(ref_model, seq, mask, P - 1)
    floor = _rel(_hf_logits(model, seq, mask, P - 1), ref32)
    ours = torch.stack(logits, 1)
    out: dict = {"rollout_rel_err_hf": floor, "rollout_rel_err_static": _rel(ours, ref32)}
    failed = {}
    if not out["rollout_rel_err_static"] <= 2 * floor + 1e-4:
        failed["static_cache"] = failed["cuda_graph"] = "static-cache logits off bounds"
    if gdec:
        out["rollout_rel_err_graph_vs_static"] = _rel(torch.stack(g_logits, 1), ours)
        if not out["rollout_rel_err_graph_vs_static"] <= 1e-3:
            failed["cuda_graph"] = "graph replay differs from the eager static-cache step"
    if failed:
        out["failed"] = failed
    return out


def check_packing(model, ref_model, ids, mask, P: int) -> dict:
    """Packed vs padded response log-probs on valid tokens, against an fp32 padded reference.

    Returns:
        The errors, plus ``"failed": {"packed": reason}`` when packed errs more than 2x the
        padded path in the run's dtype + 1e-4 (nats, max abs over valid response tokens).
    """
    rm = mask[:, P:].bool()
    with torch.no_grad():
        ref, _ = sequence_log_probs(ref_model, ids, mask, P)
        pad, _ = sequence_log_probs(model, ids, mask, P)
        pk, _ = packed_log_probs(model, ids, mask, P)
    out = {
        "logp_abs_err_padded": (pad - ref)[rm].abs().max().item(),
        "logp_abs_err_packed": (pk - ref)[rm].abs().max().item(),
    }
    if not out["logp_abs_err_packed"] <= 2 * out["logp_abs_err_padded"] + 1e-4:
        out["failed"] = {"packed": "packed log-probs off bounds"}
    return out


def train_padded(model, ids, mask, P: int, mbs: int) -> None:
    """Forward+backward of the token-mean log-prob loss, fixed micro-batches (padded)."""
    n = mask[:, P:].sum()
    for i in range(0, ids.shape[0], mbs):
        lp, _ = sequence_log_probs(model, ids[i : i + mbs], mask[i : i + mbs], P)
        (-(lp * mask[i : i + mbs, P:]).sum() / n).backward()


def train_packed(model, ids, mask, P: int, plan: list[list[int]]) -> None:
    """Same loss with packed micro-batches from the token-budget plan."""
    n = mask[:, P:].sum()
    for mb in plan:
        idx = torch.tensor(mb, device=ids.device)
        lp, _ = packed_log_probs(model, ids[idx], mask[idx], P)
        (-(lp * mask[idx, P:]).sum() / n).backward()


def main(argv: list[str] | None = None) -> int:
    """Run the checklist benchmark (see the module docstring); returns the exit code."""
    a = _args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda") if cuda else torch.device("cpu")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = _commit(a.commit)
    model = build_model(a, device)
    prompt, pmask, ids, mask = make_batch(a, device)
    B, P, R = a.batch, a.prompt_len, a.response_len
    timer = Timer(cuda)

    # ---------------- numerics first; a method that fails is reported and not timed
    dec, gdec, numerics, failed = _check_numerics(a, model, prompt, pmask, ids, mask, cuda)
    lengths = mask.sum(-1)
    budget = a.max_tokens or a.micro_batch_size * (P + R)
    plan = token_budget_micro_batches(lengths, budget, mode="packed")
    print(f"numerics {numerics}; failed {failed}; packed plan {len(plan)} micro-batches")

    # ---------------- timed rounds (methods interleaved within each round)
    k = a.micro_batch_size
    gen_kw = dict(max_new_tokens=R, eos_token_id=-1, pad_token_id=0, do_sample=False)
    methods = {
        ("rollout", "eager_dynamic_cache"): lambda: generate(model, prompt, pmask, **gen_kw),
        ("rollout", "static_cache"): lambda: dec.generate(prompt, pmask, **gen_kw),
        ("rollout", "cuda_graph"): lambda: gdec.generate(prompt, pmask, **gen_kw),
        ("train_fwd_bwd", "padded"): lambda: train_padded(model, ids, mask, P, k),
        ("train_fwd_bwd", "packed"): lambda: train_packed(model, ids, mask, P, plan),
    }
    if gdec is None:
        methods.pop(("rollout", "cuda_graph"))
    times = _time_rounds(a, model, methods, timer, failed, cuda)

    common = {
        "benchmark": "checklist",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "python": sys.version.split()[0],
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty(REPO),
        "model": {k: getattr(a, k) for k in QWEN05B} | {"model_type": a.model_type},
        "dtype": a.dtype,
        "batch": B,
        "prompt_len": P,
        "response_len": R,
        "rounds": a.rounds,
        "numerics": numerics,
        "failed": failed,
    }
    rows = _rows(a, common, times, int(lengths.sum()), len(plan))
    with open(out_dir / "checklist.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lines = _markdown(a, common, rows, int(lengths.sum()), len(plan), cuda)
    (out_dir / "checklist.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def _check_numerics(a, model, prompt, pmask, ids, mask, cuda: bool):
    """The static-cache decoder (and on CUDA its graph) against the eager rollout, and the
    packed log-probs against the padded ones, each against an fp32 copy of the model.
    Returns ``(decoder, graph decoder or None, numerics, failed: method -> why)``."""
    P, R = a.prompt_len, a.response_len
    failed: dict[str, str] = {}
    dec = StaticCacheDecoder(model, P + R, use_cuda_graph=False)
    gdec = None
    if cuda:
        try:
            gdec = StaticCacheDecoder(model, P + R, use_cuda_graph=True)
            gdec.generate(  # captures the decode loop's graph
                prompt, pmask, max_new_tokens=2, eos_token_id=None, pad_token_id=0, do_sample=False
            )
        except Exception as e:  # noqa: BLE001 - reported in the results, exit code 1
            failed["cuda_graph"] = f"capture failed: {type(e).__name__}: {e}"[:500]
            gdec = None
    ref_model = copy.deepcopy(model).float()
    numerics: dict = {}
    steps = min(8, R - 1)
    try:
        numerics.update(check_rollout(model, ref_model, dec, gdec, prompt, pmask, steps))
    except Exception as e:  # noqa: BLE001 - reported, the other items still run
        failed["static_cache"] = failed["cuda_graph"] = f"{type(e).__name__}: {e}"[:500]
    k = a.micro_batch_size
    try:
        numerics.update(check_packing(model, ref_model, ids[:k], mask[:k], P))
    except Exception as e:  # noqa: BLE001
        failed["packed"] = f"{type(e).__name__}: {e}"[:500]
    for name, why in numerics.pop("failed", {}).items():
        failed.setdefault(name, why)
    del ref_model
    if cuda:
        torch.cuda.empty_cache()
    return dec, gdec, numerics, failed


def _time_rounds(a, model, methods: dict, timer, failed: dict, cuda: bool) -> dict:
    """Warm-up and timed rounds, every method once per round in a fixed order; a method that
    failed (numerics or while timing) is dropped and named in ``failed``. Returns
    ``(item, method) -> seconds of each timed round``."""
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(a.warmup + a.rounds):
        for (item, name), fn in list(methods.items()):
            if name in failed:
                methods.pop((item, name))
                continue
            model.eval() if item == "rollout" else model.train()
            try:
                t = timer(fn)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: report, go on
                failed[name] = f"while timing: {type(e).__name__}: {e}"[:500]
                times.pop((item, name), None)
                if cuda:
                    torch.cuda.empty_cache()
                continue
            finally:
                model.zero_grad(set_to_none=True)
            if r >= a.warmup:
                times.setdefault((item, name), []).append(t)
        print(f"round {r} done", flush=True)
    return times


def _rows(a, common: dict, times: dict, valid_tokens: int, n_packed: int) -> list[dict]:
    """One record per timed method: tokens/s (generated for rollout, valid for training)."""
    B, P, R, k = a.batch, a.prompt_len, a.response_len, a.micro_batch_size
    gen_tokens, padded_tokens = B * R, B * (P + R)
    rows = []
    for (item, name), ts in times.items():
        med = statistics.median(ts)
        tok = gen_tokens if item == "rollout" else valid_tokens
        n_micro = None
        if item == "train_fwd_bwd":
            n_micro = n_packed if name == "packed" else -(-B // k)
        rows.append(
            common
            | {
                "item": item,
                "method": name,
                "metric": "tokens_per_s",
                "value": tok / med,
                "unit": "tokens/s" + (" (generated)" if item == "rollout" else " (valid)"),
                "time_s_median": med,
                "time_s_all": ts,
                "tokens": tok,
                "padded_tokens": padded_tokens if item == "train_fwd_bwd" else None,
                "micro_batches": n_micro,
            }
        )
    return rows


def _markdown(
    a, common: dict, rows: list[dict], valid_tokens: int, n_packed: int, cuda: bool
) -> list[str]:
    """The lines of ``checklist.md``: the table with speed-ups against the plain method of
    each item, the numerics and every failure."""
    B, P, R, k = a.batch, a.prompt_len, a.response_len, a.micro_batch_size
    base = {"rollout": "eager_dynamic_cache", "train_fwd_bwd": "padded"}
    ref = {r["item"]: r["value"] for r in rows if r["method"] == base[r["item"]]}
    lines = [
        f"# checklist ({common['device']}, {a.dtype}, B={B}, P={P}, R={R}, "
        f"{a.num_hidden_layers}L h{a.hidden_size} V{a.vocab_size}, commit {common['commit']}, "
        f"{common['date']})",
        "",
        "| item | method | tokens/s | median s | speed-up vs off |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        speed = f"{row['value'] / ref[row['item']]:.2f}x" if row["item"] in ref else "n/a"
        lines.append(
            f"| {row['item']} | {row['method']} | {row['value']:.0f} | "
            f"{row['time_s_median']:.3f} | {speed} |"
        )
    lines += [
        "",
        f"Numerics (checked before timing): {common['numerics']}.",
        "Rollout counts generated tokens (greedy, EOS off, R per sequence); training counts "
        f"valid tokens ({valid_tokens} of {B * (P + R)} padded); packed = packing + "
        f"token-budget micro-batches ({n_packed} vs {-(-B // k)}) + LM head only on "
        "positions that predict a response token.",
    ]
    if not cuda:
        lines.append("cuda_graph not measured: no CUDA.")
    for name, why in common["failed"].items():
        lines.append(f"FAILED {name}: {why}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
