"""Hugging Face export: the actor (and, on request, the critic) as a ``save_pretrained`` folder.

Layout of a run folder that this module reads and writes::

    run_dir/model_config/   config.json, generation_config.json, tokenizer + chat template
                            of the policy (written at setup: what an export needs besides
                            the weights)
    run_dir/hf/actor/       the final actor: AutoModelForCausalLM.from_pretrained(...)
    run_dir/hf/critic/      the critic (train.export_critic): AutoModelForTokenClassification
                            with num_labels=1, logits[..., 0] = the value of each position

Weights come from one of these sources, each yielding one full state dict on rank 0:

- a live engine without ZeRO-3 (stages 0-2 keep full parameters on every rank): its
  ``state_dict()``;
- a live ZeRO-3 engine: :func:`gather_state_dict` all-gathers the partitioned parameters
  bucket by bucket (``deepspeed.zero.GatheredParameters``), copies them to host memory on
  rank 0 and frees them before the next bucket;
- a strategy that holds only part of the model (a pipeline stage) provides
  ``full_state_dict() -> dict | None`` (the full state dict, HF names, on the first rank of
  each pipeline, global rank 0 among them; None elsewhere); :func:`engine_state_dict` uses
  it when present;
- a checkpoint (``verl-ppo export RUN_DIR [--step N] OUT_DIR``): ZeRO 0-2 from the module
  states DeepSpeed wrote, ZeRO-3 through DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``.

Cost of a ZeRO-3 export (live): every rank receives (W-1)/W of the model bytes M in all
over the gathers; device memory above the shard is one bucket (the largest parameter or
64 MiB, whichever is larger); rank 0 holds the full state dict (M) in host memory while
``save_pretrained`` writes it, the other ranks none. From a ZeRO-3 checkpoint the export
runs in one process and holds the fp32 model (4 bytes per parameter) in host memory.

Files are written into a temporary sibling folder and renamed into place, so an
interrupted export never leaves a folder that loads half a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

META_DIR = "model_config"
EXPORT_DIR = "hf"
_BUCKET_FLOOR = 64 << 20


class ExportError(RuntimeError):
    """The export cannot be done; the message names what is missing and the fix."""


# ------------------------------------------------------------------ metadata
def save_model_meta(
    run_dir: str | Path, hf_config: Any, tokenizer_source: str | Path, generation_config=None
) -> Path:
    """Write ``run_dir/model_config``: the policy's HF config, its generation config (given,
    else the model folder's ``generation_config.json``, else derived from the config) and
    the tokenizer as loaded from ``tokenizer_source`` (the model folder, before the trainer
    changes padding side), chat template included. Returns the folder."""
    from transformers import AutoTokenizer, GenerationConfig

    if generation_config is None:
        try:
            generation_config = GenerationConfig.from_pretrained(tokenizer_source)
        except OSError:
            generation_config = GenerationConfig.from_model_config(hf_config)

    out = Path(run_dir) / META_DIR
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-model_config-", dir=Path(run_dir)))
    try:
        hf_config.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------- state dicts
def _is_zero3(t: torch.Tensor) -> bool:
    return hasattr(t, "ds_id")


def gather_state_dict(
    module: torch.nn.Module, rank: int, bucket_bytes: int | None = None
) -> tuple[dict[str, torch.Tensor] | None, dict[str, float]]:
    """The full state dict of ``module`` on rank 0 (host memory, the module's dtypes);
    None on the other ranks. Collective when the module is ZeRO-3 partitioned.

    ZeRO-3 parameters are gathered in buckets of at most ``bucket_bytes`` (default: the
    largest parameter or 64 MiB, whichever is larger), each released before the next.
    Tied parameters (one tensor under two names) are gathered once.

    Returns:
        ``(state_dict | None, stats)`` with stats ``buckets``, ``gathered_bytes`` (full
        bytes of the ZeRO-3 parameters), ``bucket_bytes`` and ``seconds``.
    """
    t0 = time.perf_counter()
    named = module.state_dict(keep_vars=True)
    unique: dict[int, torch.Tensor] = {}
    for v in named.values():
        unique.setdefault(id(v), v)
    part = [v for v in unique.values() if _is_zero3(v)]
    host: dict[int, torch.Tensor] = {}
    stats = {"buckets": 0.0, "gathered_bytes": 0.0, "bucket_bytes": 0.0, "seconds": 0.0}
    if part:
        import deepspeed

        def nbytes(p: torch.Tensor) -> int:
            return int(p.ds_numel) * p.element_size()

        cap = bucket_bytes or max(_BUCKET_FLOOR, max(nbytes(p) for p in part))
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in part:
            if buckets[-1] and size + nbytes(p) > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes(p)
        for b in buckets:
            with deepspeed.zero.GatheredParameters(b, modifier_rank=None):
                if rank == 0:
                    for p in b:
                        host[id(p)] = p.data.detach().to("cpu", copy=True)
        stats.update(
            buckets=float(len(buckets)),
            gathered_bytes=float(sum(nbytes(p) for p in part)),
            bucket_bytes=float(cap),
        )
    stats["seconds"] = time.perf_counter() - t0
    if rank != 0:
        return None, stats
    for v in unique.values():
        if id(v) not in host:
            host[id(v)] = v.detach().to("cpu", copy=True)
    return {k: host[id(v)] for k, v in named.items()}, stats


def engine_state_dict(strategy: Any, rank: int) -> tuple[dict[str, torch.Tensor] | None, dict]:
    """Full state dict of a role's model on rank 0 (collective), from the strategy's own
    ``full_state_dict()`` when it has one (pipeline stages gather theirs), else
    :func:`gather_state_dict` of its module."""
    own = getattr(strategy, "full_state_dict", None)
    if callable(own):
        t0 = time.perf_counter()
        sd = own()
        return sd, {"seconds": time.perf_counter() - t0}
    return gather_state_dict(strategy.module, rank)


def checkpoint_state_dict(ckpt_dir: str | Path, role: str) -> dict[str, torch.Tensor]:
    """The full module state dict of ``role`` (``actor`` or ``critic``) in a checkpoint
    folder written by :class:`verl_ppo.run.checkpoint.CheckpointManager` (one process).

    ZeRO 0-2: DeepSpeed's ``mp_rank_00_model_states.pt`` holds full module weights.
    ZeRO-3: the fp32 weights are reassembled from every rank's optimizer partition by
    DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (fp32 model in host memory).

    Raises:
        ExportError: the role's checkpoint is missing.
    """
    root = Path(ckpt_dir) / role
    states = root / "mp_rank_00_model_states.pt"
    if states.is_file():
        return torch.load(states, map_location="cpu", weights_only=False)["module"]
    if (root / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=role))
    raise ExportError(
        f"{root} holds no DeepSpeed checkpoint of the {role}"
        + (" (run with critic, i.e. algorithm.adv_estimator=gae)" if role == "critic" else "")
    )


# --------------------------------------------------------------------- write
def _atomic_dir(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))


def _ordinary_permissions(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes of files the user creates (0666 /
    0777 less the umask): ``mkdtemp`` makes 0700 folders and writers may leave 0600 files."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _publish(tmp: Path, out_dir: Path) -> None:
    _ordinary_permissions(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _meta_model(auto_cls: Any, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return auto_cls.from_config(config, dtype=dtype)


def _dtype_of(sd: dict[str, torch.Tensor]) -> torch.dtype:
    floats = {t.dtype for t in sd.values() if t.is_floating_point()}
    if len(floats) != 1:
        raise ExportError(f"the state dict mixes float dtypes {sorted(map(str, floats))}")
    return floats.pop()


def _cast(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (None: ``sd`` unchanged)."""
    if dtype is None:
        return sd
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def _save_folder(model: torch.nn.Module, meta_dir: Path, out_dir: Path) -> Path:
    """``save_pretrained`` (safetensors) + the tokenizer/chat template of ``meta_dir``, written
    aside and renamed into ``out_dir``; returns ``out_dir``."""
    tmp = _atomic_dir(out_dir)
    try:
        _copy_meta(meta_dir, tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_causal_lm(
    state_dict: dict[str, torch.Tensor],
    meta_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the actor as a HF folder: ``save_pretrained`` (safetensors) + tokenizer and chat
    template from ``meta_dir``.

    Args:
        state_dict: the policy's full state dict (HF names, tied keys allowed).
        meta_dir: a ``model_config`` folder (see :func:`save_model_meta`).
        out_dir: the folder to create (replaced if it exists).
        dtype: cast to this dtype first (None = keep the state dict's).

    Raises:
        ExportError: the state dict does not fit the config's model (names listed).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    meta_dir, out_dir = Path(meta_dir), Path(out_dir)
    state_dict = _cast(state_dict, dtype)
    config = AutoConfig.from_pretrained(meta_dir)
    model = _meta_model(AutoModelForCausalLM, config, _dtype_of(state_dict))
    _assign(model, state_dict)
    return _save_folder(model, meta_dir, out_dir)


def write_value_model(
    state_dict: dict[str, torch.Tensor],
    meta_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the critic (:class:`~verl_ppo.roles.critic.ValueModel`: ``backbone.*`` +
    ``value_head``) as a HF token-classification model with one label: the backbone under
    the base-model prefix, ``value_head`` as the classification head.
    ``AutoModelForTokenClassification.from_pretrained(out)(ids, attention_mask=mask,
    position_ids=pos).logits[..., 0]`` are the critic's values ``(B, L)``, with
    ``pos = (mask.cumsum(-1) - 1).clamp_min(0)`` as the critic uses for left padding.

    Raises:
        ExportError: the config's family has no token-classification head of that shape.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    meta_dir, out_dir = Path(meta_dir), Path(out_dir)
    state_dict = _cast(state_dict, dtype)
    config = AutoConfig.from_pretrained(meta_dir, num_labels=1)
    try:
        model = _meta_model(AutoModelForTokenClassification, config, _dtype_of(state_dict))
    except ValueError as exc:
        raise ExportError(f"cannot export the critic of a {config.model_type}: {exc}") from exc
    prefix = model.base_model_prefix
    head = [k for k in model.state_dict() if not k.startswith(prefix + ".")]
    names = {k.rsplit(".", 1)[-1]: k for k in head}
    if set(names) != {"weight", "bias"}:
        raise ExportError(f"{type(model).__name__} has head {head}, expected one Linear(h, 1)")
    mapped = {}
    for k, v in state_dict.items():
        if k.startswith("backbone."):
            mapped[prefix + k[len("backbone") :]] = v
        elif k.startswith("value_head."):
            mapped[names[k.rsplit(".", 1)[-1]]] = v
        else:
            raise ExportError(f"unexpected critic tensor {k!r} (want backbone.* or value_head.*)")
    _assign(model, mapped)
    return _save_folder(model, meta_dir, out_dir)


def _assign(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load ``state_dict`` into a meta-device model by assignment (no copy). With tied
    embeddings a state dict may name the tied tensor once (a pipeline's stages hold it
    under one name); the other name then refers to the same tensor."""
    state_dict = dict(state_dict)
    if getattr(model.config, "tie_word_embeddings", False):
        names = {id(m): n for n, m in model.named_modules()}
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
        if inp is not None and out is not None:
            a, b = names[id(inp)] + ".weight", names[id(out)] + ".weight"
            for have, miss in ((a, b), (b, a)):
                if have in state_dict and miss not in state_dict:
                    state_dict[miss] = state_dict[have]
    want = set(model.state_dict())
    missing, extra = sorted(want - set(state_dict)), sorted(set(state_dict) - want)
    if missing or extra:
        raise ExportError(
            f"weights do not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    model.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def _copy_meta(meta_dir: Path, dest: Path) -> None:
    """Tokenizer, chat template and generation config (``save_pretrained`` writes the rest)."""
    for f in meta_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dest / f.name)


# ---------------------------------------------------------------- run folders
def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint folder of ``step`` (None = the latest complete one) in ``run_dir``,
    checked against the sizes and checksums of its marker.

    Raises:
        ExportError: no such complete checkpoint (the ones present are listed), or it is
            damaged (the file and the problem named).
    """
    from verl_ppo.run.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint

    root = Path(run_dir) / "checkpoints"
    path = latest_checkpoint(root) if step is None else root / f"step_{step:06d}"
    if path is None or not (path / "COMPLETE").is_file():
        have = [p.name for p in complete_checkpoints(root)]
        want = "a complete checkpoint" if step is None else f"step {step}"
        raise ExportError(f"{root} has no {want}; complete checkpoints: {have or 'none'}")
    problem = verify_checkpoint(path)
    if problem is not None:
        have = [p.name for p in complete_checkpoints(root) if p != path]
        raise ExportError(
            f"checkpoint {path.name} is damaged: {problem}; export another with --step N "
            f"(other complete checkpoints: {have or 'none'})"
        )
    return path


def export_checkpoint(
    run_dir: str | Path, out_dir: str | Path, step: int | None = None, critic: bool = False
) -> dict[str, Path]:
    """``verl-ppo export``: write checkpoint ``step`` (default latest) of ``run_dir`` as HF
    folders: ``out_dir`` (the actor), and ``out_dir/critic`` too with ``critic=True``.

    Weights are cast to the dtype the run trained in (``model_config/config.json``), so
    the export of a ZeRO-3 checkpoint (fp32 master weights) equals the trained module.
    Everything is written into a temporary sibling of ``out_dir`` and renamed into place
    only when complete: a failed export leaves ``out_dir`` as it was.

    Raises:
        ExportError: no such checkpoint, no ``model_config`` (a run of an older version),
            or no critic in the checkpoint (checked before anything is written).
    """
    from transformers import AutoConfig

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    meta = run_dir / META_DIR
    if not (meta / "config.json").is_file():
        raise ExportError(
            f"{meta} is missing: the run folder does not say which model it trained "
            "(written at setup by verl-ppo train since this version)"
        )
    ckpt = find_checkpoint(run_dir, step)
    for role in ("actor", "critic") if critic else ("actor",):
        if not (ckpt / role).is_dir():
            raise ExportError(
                f"{ckpt} holds no {role}"
                + (
                    ": the run trained without a critic (algorithm.adv_estimator=grpo); "
                    "drop --critic, or train with algorithm.adv_estimator=gae"
                    if role == "critic"
                    else ""
                )
            )
    dtype = getattr(AutoConfig.from_pretrained(meta), "dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tmp = _atomic_dir(out_dir)
    try:
        write_causal_lm(checkpoint_state_dict(ckpt, "actor"), meta, tmp, dtype)
        if critic:
            write_value_model(checkpoint_state_dict(ckpt, "critic"), meta, tmp / "critic", dtype)
        info = {"checkpoint": ckpt.name, "dtype": str(dtype)}
        (tmp / "verl_ppo_export.json").write_text(json.dumps(info))
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"actor": out_dir, **({"critic": out_dir / "critic"} if critic else {})}


def build_parser() -> Any:
    """The ``argparse`` parser of ``verl-ppo export``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="verl-ppo export",
        description="Write a checkpoint of a run as a Hugging Face model folder (safetensors, "
        "tokenizer, chat template).",
    )
    p.add_argument("run_dir", help="the run folder (run_dir of verl-ppo train)")
    p.add_argument("out_dir", help="folder to write (replaced if it exists)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument(
        "--critic", action="store_true", help="also write OUT_DIR/critic (runs with a critic)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``verl-ppo export RUN_DIR [--step N] OUT_DIR [--critic]``; returns the exit code."""
    import sys

    p = build_parser()
    args = p.parse_args(argv)
    try:
        written = export_checkpoint(args.run_dir, args.out_dir, args.step, args.critic)
    except ExportError as exc:
        print(f"verl-ppo export: {exc}", file=sys.stderr)
        return 2
    for role, path in written.items():
        print(f"{role}: {path}")
    return 0


def export_live(
    engines: dict[str, Any],
    rank: int,
    run_dir: str | Path,
    critic: bool = False,
    out_root: str | Path | None = None,
) -> dict[str, Path]:
    """The end-of-run export of the live engines (collective: every rank calls it).

    Writes ``out_root/actor`` (default ``run_dir/hf``) and, with ``critic``,
    ``out_root/critic`` on rank 0, from the full state dicts of :func:`engine_state_dict`.

    Returns:
        role -> folder on rank 0; ``{}`` elsewhere.
    """
    import torch.distributed as dist

    run_dir = Path(run_dir)
    root = Path(out_root) if out_root is not None else run_dir / EXPORT_DIR
    meta = run_dir / META_DIR
    written: dict[str, Path] = {}
    roles = [("actor", write_causal_lm)] + ([("critic", write_value_model)] if critic else [])
    for role, write in roles:
        sd, stats = engine_state_dict(engines[role], rank)
        if rank == 0:
            t0 = time.perf_counter()
            written[role] = write(sd, meta, root / role)
            log.info(
                "export %s -> %s: gather %.2f s (%d buckets of <= %.0f MiB), write %.2f s",
                role,
                written[role],
                stats.get("seconds", 0.0),
                int(stats.get("buckets", 0)),
                stats.get("bucket_bytes", 0.0) / 2**20,
                time.perf_counter() - t0,
            )
        del sd
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    return written
