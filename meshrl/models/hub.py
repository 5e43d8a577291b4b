"""Where a model named in a recipe lives on disk, decided once, before anything starts.

A recipe may name a model by local path, by Hugging Face hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`),
or as a GGUF file (`loader_kwargs={"gguf_file": "model-q4.gguf"}` next to `model`, or a path ending in
`.gguf`). The planner rewrites every group's model into a plain local folder with `local`
(meshrl/planning/models.py), so every role (inference, rollout's tokenizer, trainer, reference, ...) loads,
saves and syncs the same kind of model and none repeats this logic:

- a hub id resolves to its snapshot in the local huggingface_hub cache (`HF_HUB_CACHE`), downloaded
  first unless `HF_HUB_OFFLINE=1`; a model found nowhere is left as named, and the configs' checks
  report it with how to fetch it (`missing`);
- a GGUF file is dequantized once into an HF folder under `$MESHRL_CACHE/gguf/` (default
  ~/.cache/meshrl), kept for the next run: training updates full-precision weights, and a checkpoint
  of it is an ordinary HF checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def local(model: str, gguf_file: str | None = None) -> Path | None:
    """The local folder of `model` (see the module docstring), or None when it is nowhere."""
    if model.endswith(".gguf") and Path(model).is_file():
        model, gguf_file = str(Path(model).parent), Path(model).name
    path = Path(model) if Path(model).exists() else from_hub(model)
    if path is None or gguf_file is None:
        return path
    return dequantized(path, gguf_file)


def from_hub(repo_id: str) -> Path | None:
    """The cached snapshot of hub model `repo_id` (fetched first when online), or None."""
    if not _REPO_ID.match(repo_id):
        return None
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        if constants.HF_HUB_OFFLINE:
            return None
    try:
        return Path(snapshot_download(repo_id))
    except Exception:
        return None


def missing(model: str) -> str:
    """The problem line for a model found nowhere, saying how to get it."""
    if not _REPO_ID.match(model):
        return f"model: path {model!r} does not exist (build or download the model first)"
    from huggingface_hub import constants

    return (
        f"model: {model!r} is neither a local path nor a model in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}): fetch it with `hf download {model}`"
    )


def cache_root() -> Path:
    """meshrl's own cache: $MESHRL_CACHE, default ~/.cache/meshrl."""
    return Path(os.environ.get("MESHRL_CACHE", Path.home() / ".cache" / "meshrl"))


def dequantized(folder: Path, gguf_file: str) -> Path:
    """An HF folder holding GGUF file `folder/gguf_file` dequantized to float32 (made once, cached by
    the file's path, size and modification time)."""
    source = (folder / gguf_file).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{source.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already: saved, loaded and synced as plain weights
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
