"""Model cards for draft heads: rendered from `hf_bpd/templates/draft_heads.md` with real numbers, and the
Hub folder (weights + config + README.md) that `BlockDraftHeads.push_to_hub` uploads."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heads.py imports this module to write its Hub folder
    from .heads import BlockDraftHeads

TEMPLATE = "draft_heads.md"


def accuracy_table(training_log: dict | None) -> str:
    """Markdown table of the last epoch's per-head top-1 / top-k accuracy."""
    if not training_log or not training_log.get("epochs"):
        return "_not recorded_"
    last = training_log["epochs"][-1]
    topk = next((k for k in last if k.startswith("top") and k != "top1"), None)
    head = "| head | top-1 |" + (f" {topk} |" if topk else "")
    rows = [head, "| --- | --- |" + (" --- |" if topk else "")]
    for i, acc in enumerate(last["top1"]):
        rows.append(f"| {i + 1} | {acc:.3f} |" + (f" {last[topk][i]:.3f} |" if topk else ""))
    oracle = next((k for k in last if k.startswith("oracle")), None)
    if oracle:
        rows.append(
            f"\nLattice oracle ({oracle}): {last[oracle]:.2f} drafted tokens per step "
            f"on {last.get('positions', '?')} positions of the training run's validation split."
        )
    return "\n".join(rows)


def tau_table(bench: dict | None, method: str = "hf_bpd") -> str:
    """Markdown table of τ / speedup per category from an `hf-bpd bench --output` JSON."""
    if not bench or method not in bench.get("methods", {}):
        return "_not measured_"
    res = bench["methods"][method]
    rows = ["| category | τ | speedup | identical |", "| --- | --- | --- | --- |"]
    for cat, s in [*res["categories"].items(), ("**overall**", res["overall"])]:
        rows.append(f"| {cat} | {s['tau']:.2f} | {s['speedup']:.2f}× | {s['identical']} |")
    env = bench.get("environment", {})
    rows.append(
        f"\nMeasured {env.get('date', '?')} on {env.get('device', '?')}, "
        f"max_new_tokens={bench.get('args', {}).get('max_new_tokens', '?')}, {bench.get('rows', '?')} prompts."
    )
    return "\n".join(rows)


def data_recipe(manifest: dict | None) -> str:
    """One sentence per distilled run (`hf_bpd.training.ship` writes {"runs": [...]} for several)."""
    if not manifest:
        return "_not recorded_"
    runs = manifest.get("runs", [manifest])
    sentences = []
    for run in runs:
        count = run.get("num_samples", run.get("num_prompts", "?"))
        offset = f", from position {run['offset']}" if run.get("offset") else ""
        stage = f"{run['stage']}: " if run.get("stage") else ""
        sentences.append(
            f"{stage}Greedy answers of the base model itself to {count} prompts of "
            f"`{Path(str(run.get('prompts', '?'))).name}` (shuffle seed {run.get('seed', '?')}{offset}), chat "
            f"template, prompts truncated to {run.get('max_prompt_tokens', '?')} tokens, "
            f"max_new_tokens={run.get('max_new_tokens', '?')}; produced with `hf-bpd distill`."
        )
    return sentences[0] if len(sentences) == 1 else "\n".join(f"- {x}" for x in sentences)


def render_card(
    heads: BlockDraftHeads,
    repo_id: str = "<repo_id>",
    training_log: dict | None = None,
    bench: dict | None = None,
    manifest: dict | None = None,
    top_k: int = 10,
    max_tree_tokens: int | str = 32,
    self_loading: bool = False,
) -> str:
    """The model card: metadata (`huggingface_hub.ModelCardData`) and the template filled with real numbers.
    `self_loading`: the folder is a saved drafter (`BlockDrafter.save_pretrained`), so the card also shows
    the Hub-style call that needs no drafter object."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg = heads.config
    template = resources.files("hf_bpd").joinpath("templates", TEMPLATE).read_text(encoding="utf-8")
    softmax = "tied to the base LM head" if cfg.tie_lm_head else "of its own"
    if cfg.draft_vocab_size:
        softmax += f", over a {cfg.draft_vocab_size}-token draft vocabulary"
    inputs = {
        "": "the base model's last hidden state",
        "next": "the base model's last hidden state and the embedding of its own next token (the draft tree's root)",
        "previous": "the base model's last hidden state and the embedding of the token right before the head's "
        "target (head 1: the base model's own next token; head i: the drafted token at depth i-1, so each "
        "tree branch is drafted from its own tokens)",
    }[cfg.token_input]
    if getattr(cfg, "copy_dim", 0):
        inputs += (
            f"; each head also points into the context (prompt and answer so far: a {cfg.copy_dim}-wide "
            "attention from the bigram it continues to every earlier bigram) and mixes the token that followed "
            "there into its own distribution, so it can copy names, numbers and phrases from the prompt"
        )
    hub_call = (
        "\nThis repository is a whole drafter (heads, settings in `drafter.json`, `custom_generate/`), so it also "
        "decodes with no drafter object:\n\n```python\nout = model.generate(**inputs, max_new_tokens=128, "
        f'custom_generate="{repo_id}", trust_remote_code=True)\n```\n'
    )
    body = template.format(
        self_loading=hub_call if self_loading else "",
        base_model=cfg.base_model_name or "unknown",
        repo_id=repo_id,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        softmax=softmax,
        inputs=inputs,
        top_k=top_k,
        max_tree_tokens=max_tree_tokens,
        data_recipe=data_recipe(manifest),
        accuracy_table=accuracy_table(training_log),
        tau_table=tau_table(bench),
    )
    data = ModelCardData(
        library_name="hf_bpd",
        base_model=cfg.base_model_name or None,
        tags=["blockwise-parallel-decoding", "speculative-decoding", "draft-heads", "custom_generate"],
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def save_hub_folder(heads: BlockDraftHeads, folder: str | Path, repo_id: str = "<repo_id>", **card_kwargs) -> Path:
    """Everything `push_to_hub` uploads: safetensors weights, config.json and README.md."""
    folder = Path(folder)
    heads.save_pretrained(folder)
    (folder / "README.md").write_text(render_card(heads, repo_id, **card_kwargs), encoding="utf-8")
    return folder


def load_json(path: str | Path | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else None
