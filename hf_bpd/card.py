"""Model cards for draft heads, rendered with real numbers from the template `model_cards/template.md` at the
repository root (`setup.py` ships it inside the wheel as `hf_bpd/model_cards/`), and the Hub folder (weights +
config + README.md) that `BlockDrafter.save_pretrained` and `push_to_hub` write. The cards of the head sets
shipped in the package live beside the template (`model_cards/<packaged model>.md`, written by
`python -m hf_bpd.training.ship`).

This module imports nothing of the library: `heads.py` imports it, never the other way round (the heads are
read through `heads.config` and `heads.save_pretrained` only)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

TEMPLATE = "template.md"
CARDS_FOLDER = "model_cards"  # at the repository root; inside the installed package as hf_bpd/model_cards/
CHECKOUT_CARDS = Path(__file__).resolve().parents[1] / CARDS_FOLDER


def template_text() -> str:
    """The card template: the installed package's copy (`hf_bpd/model_cards/template.md`, mapped there by
    setup.py from the repository's `model_cards/`), or in a source checkout or an editable install, where the
    package folder has none, `model_cards/template.md` itself."""
    installed = resources.files("hf_bpd").joinpath(CARDS_FOLDER, TEMPLATE)
    if installed.is_file():
        return installed.read_text(encoding="utf-8")
    return (CHECKOUT_CARDS / TEMPLATE).read_text(encoding="utf-8")


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
    if (training_log.get("args") or {}).get("init"):
        # the split is drawn afresh over each run's data, so an earlier run may have trained on some of it
        rows.append(
            "\nThese heads continue earlier heads (`--init`); the earlier runs may have trained on part of this "
            "split, so read its accuracy as an upper bound. The Spec-Bench τ below is the measure."
        )
    return "\n".join(rows)


def layer_training_summary(training_log: dict | None) -> str:
    """What an EAGLE draft layer's training log (`hf-bpd train-eagle`) says of the run: its steps, data and
    loss (it records no held-out accuracy; the Spec-Bench τ below is the measure)."""
    if not training_log or not training_log.get("steps"):
        return "_not recorded_"
    args = training_log.get("args") or {}
    losses = training_log.get("loss_by_50_steps") or []
    fusion = args.get("feature_layers")
    lines = [
        f"`hf-bpd train-eagle`: {training_log['steps']} steps ({training_log.get('epochs_done', '?')} epochs) over "
        f"{args.get('samples', '?')} distilled answers, batches of {args.get('batch_samples', '?')}, "
        f"learning rate {args.get('lr', '?')}, trained on its own drafts {args.get('depth', '?')} deep"
        + (f", reading the base model's layers {fused_layers(fusion)} and its final state fused" if fusion else "")
        + (", continuing an earlier layer (`--init`)" if args.get("init") else "")
        + "."
    ]
    if losses:
        lines.append(f"Loss (mean of 50 steps): {losses[0]:.2f} at the start, {losses[-1]:.2f} at the end.")
    return "\n".join(lines)


def tau_table(bench: dict | None, method: str = "hf_bpd") -> str:
    """Markdown table of τ / speedup per category from an `hf-bpd bench --output` JSON (or its summary,
    `bench_summary`)."""
    if not bench or method not in bench.get("methods", {}):
        return "_not measured_"
    res = bench["methods"][method]
    rows = ["| category | τ | speedup | identical |", "| --- | --- | --- | --- |"]
    for cat, s in [*res["categories"].items(), ("**overall**", res["overall"])]:
        rows.append(f"| {cat} | {s['tau']:.2f} | {s['speedup']:.2f}× | {s['identical']} |")
    env = bench.get("environment", {})
    turns = res["overall"].get("turns")
    over = res["overall"].get("speedup_over")
    rows.append(
        f"\nMeasured {env.get('date', '?')} on {env.get('device', '?')}, "
        f"max_new_tokens={bench.get('args', {}).get('max_new_tokens', '?')}, {bench.get('rows', '?')} prompts"
        + (f" ({turns} turns)" if turns and turns != bench.get("rows") else "")
        + ". Speedup: tokens per second over "
        + (
            f"the fastest plain method of the run, per category (overall: `{over}`)."
            if over
            else "plain greedy `generate`."
        )
    )
    return "\n".join(rows)


def bench_summary(bench: dict, method: str = "hf_bpd") -> dict:
    """What `tau_table` reads of an `hf-bpd bench` JSON, for one method: shipped beside the heads
    (`bench.json`) so that their card is rendered from the package's assets alone. A merged report
    (`--merge`) has no `args`: they are read from its first part's JSON where that file is at hand."""
    args = bench.get("args")
    if args is None and bench.get("parts") and Path(bench["parts"][0]["file"]).is_file():
        args = json.loads(Path(bench["parts"][0]["file"]).read_text()).get("args")
    keep = ("tau", "speedup", "speedup_over", "identical", "turns")
    res = bench["methods"][method]
    return {
        "environment": {k: bench.get("environment", {}).get(k) for k in ("date", "device", "commit")},
        "args": {"max_new_tokens": (args or {}).get("max_new_tokens", "?")},
        "rows": bench.get("rows", bench.get("turns", "?")),
        "methods": {
            method: {
                "overall": {k: v for k, v in res["overall"].items() if k in keep},
                "categories": {c: {k: v for k, v in s.items() if k in keep} for c, s in res["categories"].items()},
            }
        },
    }


def precision_summary(report: dict, setting: str = "k10 n16 lookup10", alone: str = "k10 n16 lookup0") -> dict:
    """What `precision_note` reads of a `research.perturbed_base_tau` JSON (τ of the heads on the packaged
    model and on it perturbed, with drafter `setting` and with the heads alone): shipped beside the heads
    (`precision.json`) so that their card is rendered from the package's assets alone."""
    drafters = report["drafters"]
    return {
        "environment": {k: report.get("environment", {}).get(k) for k in ("date", "commit")},
        "rows": report["rows"],
        "turns": report["turns"],
        "max_new_tokens": report["args"]["max_new_tokens"],
        "noise_steps": report["args"]["steps"],
        "setting": setting,
        "tau": {model: drafters[f"{model} {setting}"]["overall"]["tau"] for model in ("packaged", "perturbed")},
        "tau_heads_alone": {
            model: drafters[f"{model} {alone}"]["overall"]["tau"] for model in ("packaged", "perturbed")
        },
        "identical_turns": report["identity_check"]["identical_turns"],
        "checked_turns": report["identity_check"]["turns"],
        "repeated_4gram_share": {model: a["repeated_4gram_share"] for model, a in report["answers"].items()},
    }


def precision_note(precision: dict | None) -> str:
    """The card's section on the base model in another precision, from `precision_summary` (none when not
    measured)."""
    if not precision:
        return ""
    tau, alone, repeated = precision["tau"], precision["tau_heads_alone"], precision["repeated_4gram_share"]
    k, n, lookup = (part[len(key) :] for part, key in zip(precision["setting"].split(), ("k", "n", "lookup")))
    return (
        "\n## The base model in another precision\n\n"
        "The heads recognise their base model in any precision or quantisation: their config records a sample of "
        "its LM-head weights, compared by correlation. With every weight matrix of the packaged model moved by "
        f"seeded uniform noise of up to {precision['noise_steps']:g} Q4_1 step per weight (a stand-in for the "
        "un-quantised checkpoint, which is not available offline: that lies up to this far from the packaged Q4_1 "
        "matrices and closer to the Q8_0 embedding, and the noise, drawn apart from the rounding, makes a worse "
        f"model than it), the heads alone (context lookup off) reached τ {alone['perturbed']:.2f} against "
        f"{alone['packaged']:.2f} on the packaged model, on "
        f"{precision['turns']} turns of {precision['rows']} Spec-Bench dev rows (top-k {k}, {n}-token trees, "
        f"max_new_tokens={precision['max_new_tokens']}, `hf-bpd replay`'s method); with context lookup {lookup}, "
        f"{tau['perturbed']:.2f} against {tau['packaged']:.2f} (lookup copies repeated text: "
        f"{repeated['perturbed']:.0%} of the perturbed model's answer 4-grams repeat an earlier one, "
        f"{repeated['packaged']:.0%} of the packaged model's). Decoding the perturbed model stayed identical to "
        f"its greedy output on {precision['identical_turns']} of {precision['checked_turns']} turns.\n"
    )


def prompt_template(manifest: dict | None) -> str:
    """How the distilled prompts were written: "chat" (the tokenizer's chat template, also for manifests
    written before templates were recorded) or the template with {prompt} of a base model's runs."""
    runs = (manifest or {}).get("runs", [manifest] if manifest else [])
    return next((r["prompt_template"] for r in runs if r.get("prompt_template", "chat") != "chat"), "chat")


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
        template = run.get("prompt_template", "chat")
        framing = "chat template" if template == "chat" else f"prompts written as {template!r}, no chat template"
        sentences.append(
            f"{stage}Greedy answers of the base model itself to {count} prompts of "
            f"`{Path(str(run.get('prompts', '?'))).name}` (shuffle seed {run.get('seed', '?')}{offset}), "
            f"{framing}, prompts truncated to {run.get('max_prompt_tokens', '?')} tokens, "
            f"max_new_tokens={run.get('max_new_tokens', '?')}; produced with `hf-bpd distill`."
        )
    return sentences[0] if len(sentences) == 1 else "\n".join(f"- {x}" for x in sentences)


def heads_description(cfg) -> str:
    """The card's opening of draft heads of config `cfg`: what they are and read, up to "drafts are verified"."""
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
    chain = getattr(cfg, "chain", "")
    if chain:
        where = "in place of the hidden state" if chain == "state" else "beside the hidden state"
        inputs += f"; head i > 1 reads head i-1's state {where}, so each node has read its whole branch"
    if getattr(cfg, "copy_dim", 0):
        inputs += (
            f"; each head also points into the context (prompt and answer so far: a {cfg.copy_dim}-wide "
            "attention from the bigram it continues to every earlier bigram) and mixes the token that followed "
            "there into its own distribution, so it can copy names, numbers and phrases from the prompt"
        )
    return (
        f"{cfg.num_heads} draft heads ({cfg.num_layers} residual layer(s) each, softmax {softmax}) for lossless "
        "blockwise\nparallel decoding with [hf_bpd](https://pypi.org/project/hf-bpd/) (Kim et al., NeurIPS 2024, "
        f"arXiv 2404.09221).\nEach head reads {inputs}.\nHead i predicts the token i+1 positions after the base "
        "model's own next token;"
    )


def fused_layers(feature_layers: list[int], sep: str = ", ") -> str:
    """The decoder layers a fusion reads besides the final hidden state, as the card names them."""
    # A negative entry (heads.FINAL_HIDDEN_STATE) names the final state; this module imports nothing of the library.
    return sep.join(str(i) for i in feature_layers if i >= 0)


def eagle_description(cfg) -> str:
    """The card's opening of an EAGLE draft layer of config `cfg`, up to "drafts are verified"."""
    fused = getattr(cfg, "feature_layers", None)
    features = (
        f"hidden states there after layers {fused_layers(fused, ' and ')} and its final state, fused as EAGLE-3 does,"
        if fused
        else "final hidden state there"
    )
    return (
        "An EAGLE draft layer (one decoder layer drafting on the base model's own features; Li et al., 2024) for\n"
        "lossless speculative decoding with [hf_bpd](https://pypi.org/project/hf-bpd/). Each position's row reads "
        f"the\nbase model's {features} and the token after it and predicts the next position's state; "
        "a\ndraft of depth d > 1 reads the state its parent predicted, so each tree branch is drafted from its own "
        f"tokens,\n{cfg.max_depth} deep at most, over a {cfg.draft_vocab_size or cfg.vocab_size}-token draft "
        "vocabulary;"
    )


def render_card(
    heads: PreTrainedModel | PretrainedConfig,
    repo_id: str = "<repo_id>",
    training_log: dict | None = None,
    bench: dict | None = None,
    manifest: dict | None = None,
    top_k: int = 10,
    max_tree_tokens: int | str = 32,
    self_loading: bool = False,
    packaged: str | None = None,
    settings: dict | None = None,
    precision: dict | None = None,
) -> str:
    """The model card: metadata (`huggingface_hub.ModelCardData`) and the template filled with real numbers.
    `heads`: the draft heads or their config. `self_loading`: the folder is a saved drafter
    (`BlockDrafter.save_pretrained`), so the card also shows the Hub-style call that needs no drafter object.
    `packaged`: the heads ship inside hf_bpd for this packaged model (`hf_bpd.load_packaged_model`), with
    `settings` (their drafter.json): the card loads them from the package instead of `repo_id`. `precision`:
    τ measured on the base model perturbed (`precision_summary`)."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg = getattr(heads, "config", heads)
    layer = getattr(cfg, "model_type", "") == "bpd_eagle_draft_layer"
    if layer:
        title, description = "EAGLE draft layer", eagle_description(cfg)
        training_heading, training = "Training", layer_training_summary(training_log)
    else:
        title, description = "Block draft heads", heads_description(cfg)
        training_heading = "Per-head accuracy (the training run's validation split of the distilled samples)"
        training = accuracy_table(training_log)
    hub_call = (
        "\nThis repository is a whole drafter (heads, settings in `drafter.json`, `custom_generate/`), so it also "
        "decodes with no drafter object:\n\n```python\nout = model.generate(**inputs, max_new_tokens=128, "
        f'custom_generate="{repo_id}", trust_remote_code=True)\n```\n'
    )  # the template closes the usage block with "```\n{self_loading}\n"
    base_model = cfg.base_model_name or "unknown"
    if packaged:
        shown = ", ".join(f"{k}={v!r}" for k, v in (settings or {}).items())
        module = "layer" if layer else "heads"
        usage_note = (
            f"\n{'This layer ships' if layer else 'These heads ship'} inside hf_bpd for its packaged model "
            f"`{packaged}`: both load offline, the {module} with the drafter settings chosen by measurement "
            f"(`drafter.json`: {shown}).\n"
        )
        load_model = f'model, tokenizer = hf_bpd.load_packaged_model("{packaged}")'
        load_drafter = f'drafter = hf_bpd.load_packaged_drafter(model="{packaged}")'
    else:
        usage_note = ""
        load_model = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{base_model}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{base_model}")'
        )
        load_drafter = (
            f'drafter = hf_bpd.BlockDrafter.from_pretrained("{repo_id}", top_k={top_k}, '
            f"max_tree_tokens={max_tree_tokens!r})"
        )
    template = prompt_template(manifest)
    if template == "chat":
        prompt = (
            "inputs = tokenizer.apply_chat_template(\n"
            '    [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, return_tensors="pt", '
            "return_dict=True\n)"
        )
    else:  # a base model: the prompt format the heads were distilled on
        prompt = f'inputs = tokenizer({json.dumps(template.replace("{prompt}", "Hi!"))}, return_tensors="pt")'
    body = template_text().format(
        usage_note=usage_note,
        load_model=load_model,
        load_drafter=load_drafter,
        prompt=prompt,
        self_loading=hub_call if self_loading else "",
        base_model=base_model,
        title=title,
        description=description,
        data_recipe=data_recipe(manifest),
        training_heading=training_heading,
        accuracy_table=training,
        tau_table=tau_table(bench),
        precision_note=precision_note(precision),
    )
    data = ModelCardData(
        library_name="hf_bpd",
        base_model=cfg.base_model_name or None,
        tags=["blockwise-parallel-decoding", "speculative-decoding", "draft-heads", "custom_generate"],
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def save_hub_folder(heads: PreTrainedModel, folder: str | Path, repo_id: str = "<repo_id>", **card_kwargs) -> Path:
    """Everything `push_to_hub` uploads: safetensors weights, config.json and README.md."""
    folder = Path(folder)
    heads.save_pretrained(folder)
    (folder / "README.md").write_text(render_card(heads, repo_id, **card_kwargs), encoding="utf-8")
    return folder


def load_json(path: str | Path | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else None
