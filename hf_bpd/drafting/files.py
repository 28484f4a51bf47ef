"""A drafter's files: the folder `BlockDrafter.save_pretrained` writes (its heads, `drafter.json` with its
settings and rescorer, a model card and a `custom_generate/` folder), loading it back from a folder or a
Hub repo, and uploading it."""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from .heads import BlockDraftHeads

if TYPE_CHECKING:
    from .drafter import BlockDrafter
    from .eagle import EagleDraftLayer

DRAFTER_SETTINGS = "drafter.json"
CORPUS_FILE = "corpus.npz"  # a retrieval corpus (`corpus.py`), where the drafter has one
FALLBACK_FOLDER = "fallback"  # an EAGLE layer's fallback drafter (heads and their drafter.json), where it has one


def drafter_settings(drafter: BlockDrafter) -> dict:
    """What `drafter.json` records: every constructor setting that travels with the heads (the rescorer
    as its spec; a forward-cost curve is measured on each machine instead)."""
    return {
        "top_k": drafter.top_k,
        "max_tree_tokens": drafter.max_tree_tokens,
        "context_lookup": drafter.context_lookup,
        **({"context_lookup_nodes": drafter.context_lookup_nodes} if drafter.context_lookup_nodes else {}),
        **({"lookup_after_drafts": drafter.lookup_after_drafts} if drafter.lookup_after_drafts else {}),
        "calibrate": drafter.calibration is not None,
        "packed_linear": drafter.packed_linear,
        **({"compact_weights": True} if drafter.compact_weights else {}),
        **({"context_vocab": True} if drafter.context_vocab else {}),
        **({"corpus": CORPUS_FILE, "corpus_nodes": drafter.corpus_nodes} if drafter.corpus is not None else {}),
        **({"fallback": FALLBACK_FOLDER} if drafter.fallback is not None else {}),
    }


def with_files(settings: dict, folder: Path, cls: type[BlockDrafter]) -> dict:
    """`settings` read from a `drafter.json` in `folder`, with the files they name there: the corpus file's
    name as its path (the drafter loads it), the fallback folder's name as the `cls` drafter loaded from it."""
    if isinstance(settings.get("corpus"), str):
        settings = {**settings, "corpus": folder / settings["corpus"]}
    if isinstance(settings.get("fallback"), str):
        settings = {**settings, "fallback": load_drafter(cls, folder / settings["fallback"])}
    return settings


def load_drafter(cls: type[BlockDrafter], path: str | Path, base_tokenizer=None, **kwargs) -> BlockDrafter:
    """`BlockDrafter.from_pretrained`: the heads saved at `path` (a folder or Hub repo id), with the settings
    of its `drafter.json` (and rescorer) where it has one; keyword arguments override them."""
    from .rescoring.composed import build_rescorer

    hub = {k: kwargs.pop(k) for k in ("revision", "token", "local_files_only") if k in kwargs}
    heads = drafting_module(path, **hub)
    folder, settings = read_settings(path, hub)
    settings = with_files({k: v for k, v in settings.items() if k not in kwargs}, folder, cls)  # given: unread
    spec = settings.pop("rescorer", None)
    if spec is not None and "rescorer" not in kwargs:
        kwargs["rescorer"] = build_rescorer(spec, folder, base_tokenizer)
    return cls(heads, **{**settings, **kwargs})


def drafting_module_class(path: str | Path, **hub) -> type[BlockDraftHeads] | type[EagleDraftLayer]:
    """The class of the drafting module saved at `path`: an EAGLE draft layer where its config says so, else
    draft heads (whose loader names a folder that is neither)."""
    from .eagle import EagleDraftLayer, EagleDraftLayerConfig

    try:
        config, _ = EagleDraftLayerConfig.get_config_dict(path, **hub)
    except OSError:
        config = {}
    return EagleDraftLayer if config.get("model_type") == EagleDraftLayerConfig.model_type else BlockDraftHeads


def drafting_module(path: str | Path, **hub) -> BlockDraftHeads | EagleDraftLayer:
    """The drafting module saved at `path` (`drafting_module_class` says which kind)."""
    return drafting_module_class(path, **hub).from_pretrained(path, **hub)


def save_drafter(drafter: BlockDrafter, path: str | Path, repo_id: str = "<repo_id>", **card_kwargs) -> Path:
    """`BlockDrafter.save_pretrained`: the folder that loads itself (module docstring)."""
    from ..card import save_hub_folder
    from .rescoring.composed import save_spec

    folder = Path(path)
    settings = drafter_settings(drafter)
    if drafter.rescorer is not None:
        spec = getattr(drafter.rescorer, "spec", None)
        if spec is None:
            raise ValueError(
                f"{type(drafter.rescorer).__name__} was not built from a spec (`hf_bpd.drafting.rescoring.composed."
                "build_rescorer`), so it cannot be saved: save drafter.with_rescorer(None), or build it from one"
            )
        settings["rescorer"] = save_spec(spec, Path(drafter.rescorer.spec_folder), folder)
    card = {"top_k": drafter.top_k, "max_tree_tokens": drafter.max_tree_tokens, "self_loading": True, **card_kwargs}
    save_hub_folder(drafter.heads, folder, repo_id, **card)
    if drafter.corpus is not None:
        drafter.corpus.save(folder / CORPUS_FILE)
    if drafter.fallback is not None:  # its heads and settings: the card and custom_generate/ are the layer's
        if drafter.fallback.rescorer is not None or drafter.fallback.corpus is not None:
            raise ValueError("a fallback drafter is saved as heads and settings: give it no rescorer or corpus")
        drafter.fallback.heads.save_pretrained(folder / FALLBACK_FOLDER)
        fallback_settings = json.dumps(drafter_settings(drafter.fallback), indent=2) + "\n"
        (folder / FALLBACK_FOLDER / DRAFTER_SETTINGS).write_text(fallback_settings, encoding="utf-8")
    (folder / DRAFTER_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    strategy = resources.files("hf_bpd").joinpath("custom_generate")
    (folder / "custom_generate").mkdir(exist_ok=True)
    for name in ("generate.py", "requirements.txt"):
        with resources.as_file(strategy.joinpath(name)) as source:
            shutil.copy(source, folder / "custom_generate" / name)
    return folder


def push_drafter(
    drafter: BlockDrafter,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload hf_bpd drafter",
    **card_kwargs,
) -> str:
    """`BlockDrafter.push_to_hub`: exactly the folder `save_pretrained` writes, uploaded."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        drafter.save_pretrained(folder, repo_id, **card_kwargs)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    return str(info)


def read_settings(path: str | Path, hub: dict) -> tuple[Path, dict]:
    """(the folder holding the drafter's files, the settings of its `drafter.json`, or {} without one)."""
    folder = Path(path)
    if not folder.is_dir():  # a Hub repo id: the whole repo, so a rescorer's files come along
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(path), **hub))
    settings_file = folder / DRAFTER_SETTINGS
    return folder, json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
