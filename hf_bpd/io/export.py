"""`hf-bpd export`: draft heads as a Medusa speculative model for vLLM or TensorRT-LLM.

    hf-bpd export HEADS --format vllm-medusa --output DIR [--base-model BASE]
    hf-bpd export HEADS --format tensorrt-llm-medusa --output DIR [--base-model BASE] [--tree-size N]

What maps onto Medusa. Medusa (Cai et al., 2024) heads read the base model's last hidden state only: head
i is `num_layers` residual blocks `x + SiLU(W x + b)` and a softmax layer. Plain hf_bpd heads
(`token_input=""`, no context copy) are exactly that: `heads.i.j.linear` is Medusa's block j of head i
(same residual form, same SiLU, with bias). hf_bpd heads share ONE softmax layer: the base model's LM head
(`tie_lm_head=True`: not stored in the heads checkpoint, so the export reads it from `--base-model`,
after checking the heads' LM-head fingerprint against it) or the heads' own `lm_head` (stored: no base
model needed). With a draft vocabulary (`draft_vocab_size` S > 0) the softmax layer has the S rows of the
draft tokens, and `draft_vocab` maps row -> token id. Heads that read a token embedding
(`token_input="next"` / `"previous"`) or point into the context (`copy_dim`) have no Medusa form: the
export refuses them (`ExportError`, naming why) before writing anything. An LM head with a bias is refused
too (Medusa's softmax layers have none).

vLLM (`--format vllm-medusa`), followed from vLLM 0.11.0 (the PyPI wheel): `vllm/transformers_utils/
configs/medusa.py` (MedusaConfig) and `vllm/model_executor/models/medusa.py` (Medusa, ResidualBlock,
load_weights). The folder holds
  config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size (the
                     base model's), num_heads, num_hidden_layers (residual blocks per head),
                     truncated_vocab_size (S; = vocab_size without a draft vocabulary), medusa_fc_bias
                     true (vLLM builds the block Linears without bias unless set), original_lm_head true
                     (one ParallelLMHead shared by all heads, read from `lm_heads.0.weight`: what hf_bpd's
                     one softmax layer is), max_paths / topk (MedusaConfig defaults), and `hf_bpd` (the
                     source heads' base model name and LM-head fingerprint, for `import_medusa`).
  model.safetensors  blocks.{i}.layers.{j}.weight [H, H], blocks.{i}.layers.{j}.bias [H],
                     lm_heads.0.weight [S, H], and token_map [S] (int64, row -> token id) when S < V.
vLLM's Medusa proposer drafts one chain (each head's argmax), so no tree goes with this format.

TensorRT-LLM (`--format tensorrt-llm-medusa`): the Medusa-heads folder that TensorRT-LLM's
`examples/medusa/convert_checkpoint.py --medusa_model_dir` reads through
`tensorrt_llm/models/medusa/weight.py::load_medusa_hf` (the variant that falls back to
`medusa_lm_head.safetensors` when no `.pt` exists and always reads the biases) and
`tensorrt_llm/models/medusa/config.py` / `model.py` (read from NVIDIA/TensorRT-LLM's GitHub source, whose
tensorrt_llm/version.py there says 1.0.0rc4; the project publishes no wheel on PyPI to pin a file to). The
convert_checkpoint.py flags in `SERVE_HINTS` (`--num_medusa_heads`, `--num_medusa_layers`,
`--max_medusa_token_len`) are those of its argument parser; newer examples/medusa/README.md spells the heads
override `--fixed_num_medusa_heads`. The folder holds
  config.json                 medusa_num_heads (model.py reads it) and num_medusa_heads (config.py reads
                              that name), medusa_num_layers, hidden_size, vocab_size,
                              base_model_name_or_path, max_draft_len, and `hf_bpd` as above.
  medusa_lm_head.safetensors  {i}.{j}.linear.weight [H, H], {i}.{j}.linear.bias [H], {i}.{L}.weight
                              [V, H] (each head's softmax layer: the same rows, repeated per head, as the
                              loader reads one per head; L = num_layers).
  medusa_choices.json         the static tree, as Medusa choices (below); pass it to `run.py
                              --medusa_choices` and its length to convert_checkpoint.py
                              `--max_medusa_token_len`.
TensorRT-LLM's Medusa softmax layer covers the whole (padded) vocabulary with no token map, so heads with a
draft vocabulary are refused for this format (writing zeros elsewhere would change their distribution).

Medusa choices (`medusa_choices`): a static tree of tree_size nodes, root included (`--tree-size`, default
64: TensorRT-LLM's default max_draft_len 63 plus the root). Node (r1, ..., rd) drafts head 1's rank-r1
token, ..., head d's rank-rd token. `rank_probs[i][r]` is the probability that head i's rank-r token is
right; under the heads' independence a node is accepted with the product along its path, and the expected
accepted length of a tree is the sum of its nodes' probabilities (hf_bpd's own tree objective,
`assembly.best_tree_size`). The export keeps the tree_size - 1 nodes of highest product: `Lattice.best_prefixes`
on a lattice whose "tokens" are the ranks, the same search that builds hf_bpd's trees per step, here on the
average lattice. `rank_probs` comes from `--rank-accuracy FILE` (JSON, [heads][ranks], e.g. measured
accuracies; preferred) or else from the heads themselves: their mean top-k softmax probabilities on the base
model's hidden states along a short greedy continuation of its BOS token (a crude self-estimate, for
untrained or uncalibrated heads only a placeholder). Which tree size pays on a device is what `hf-bpd
cost-model` measures (its forward-cost curve t(n)); pass that n as `--tree-size`.

speculators (PyPI `speculators` 0.9.0, read from its wheel): not a target. Its registered speculator types
(`SpeculatorModelConfig.register`: eagle3, mtp, dflash, dflash2, dspark, peagle, xpress) are all drafters
with their own transformer layers that read token embeddings beside the verifier's hidden states; none is
a hidden-state-only residual head, so these heads have no speculators form (and the package pins
transformers <= 5.19, below the 5.24 this project runs).

Round trip: `import_medusa(folder, base_model)` reads an exported vLLM folder back into `BlockDraftHeads`
(untied: the exported rows become the heads' own `lm_head`; the token map becomes the draft vocabulary),
whose logits equal the original heads' (tests/test_export.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..drafting.heads import BlockDraftHeads, BlockDraftHeadsConfig
from ..drafting.lattice import Lattice

FORMATS = ("vllm-medusa", "tensorrt-llm-medusa")
VLLM_WEIGHTS = "model.safetensors"
TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"
TRTLLM_CHOICES = "medusa_choices.json"
DEFAULT_TREE_SIZE = 64
DEFAULT_TOP_K = 10  # Medusa's topk: ranks per head a tree may use
CALIBRATION_TOKENS = 64


class ExportError(ValueError):
    """Heads that the requested format cannot express, or a missing input; raised before writing."""


def medusa_blockers(heads: BlockDraftHeads) -> list[str]:
    """Why these heads have no Medusa form (empty: they have one)."""
    cfg = heads.config
    why = []
    if cfg.token_input:
        why.append(
            f"token_input={cfg.token_input!r}: each head's first block also reads a token embedding "
            f"(x + SiLU(W [x; e(token)] + b)), while a Medusa head reads the base hidden state only"
        )
    if cfg.copy_dim:
        why.append(
            f"copy_dim={cfg.copy_dim}: the heads point into the context (context copy), which Medusa has no part for"
        )
    if getattr(cfg, "feature_layers", None):
        why.append(
            f"feature_layers={cfg.feature_layers}: the heads read a fusion of several layers' hidden states, while a "
            "Medusa head reads the last hidden state only"
        )
    return why


def check_exportable(heads: BlockDraftHeads, format: str) -> None:
    """Raise ExportError naming every reason `heads` cannot be written in `format`."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; known: {', '.join(FORMATS)}")
    why = medusa_blockers(heads)
    if format == "tensorrt-llm-medusa" and heads.config.draft_vocab_size:
        why.append(
            f"draft vocabulary of {heads.config.draft_vocab_size} tokens: TensorRT-LLM's Medusa softmax layer "
            "covers the whole vocabulary and has no token map (export to vllm-medusa, which has one)"
        )
    if why:
        raise ExportError("these draft heads cannot be exported as Medusa heads: " + "; ".join(why))


def softmax_rows(heads: BlockDraftHeads, base_model=None) -> torch.Tensor:
    """The heads' softmax layer `[S, hidden]` (row s scores token `draft_vocab[s]`): their own `lm_head`
    when stored, else the base model's LM-head rows (checked against the heads' fingerprint)."""
    if base_model is not None:
        heads.bind(base_model)  # raises when the heads were made for another base model
    if heads.lm_head is not None:
        return heads.lm_head.weight.detach()
    if base_model is None:
        raise ExportError(
            "these heads are tied to the base model's LM head (tie_lm_head=True), which their checkpoint does not "
            "store: pass the base model (--base-model PATH) so the export can write its LM-head rows"
        )
    lm_head = base_model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:
        raise ExportError("the base model's LM head has a bias, which Medusa's softmax layers do not have")
    return lm_head.weight.detach()[heads.draft_vocab.to(lm_head.weight.device)]


def _metadata(heads: BlockDraftHeads) -> dict:
    cfg = heads.config
    return {
        "base_model_name": cfg.base_model_name,
        "base_model_type": cfg.base_model_type,
        "base_lm_head_fingerprint": cfg.base_lm_head_fingerprint,
        "base_lm_head_sketch": cfg.base_lm_head_sketch,
    }


def _blocks(heads: BlockDraftHeads):
    """(head i, block j, weight, bias) of every residual block."""
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head):
            yield i, j, block.linear.weight.detach(), block.linear.bias.detach()


def _fresh_output(output) -> Path:
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder: choose a new --output")
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path))


def export_vllm_medusa(heads: BlockDraftHeads, output, base_model=None) -> Path:
    """Write `heads` as a vLLM Medusa speculative model (module docstring) to the new folder `output`."""
    check_exportable(heads, "vllm-medusa")
    rows = softmax_rows(heads, base_model)
    out = _fresh_output(output)
    cfg = heads.config
    tensors = {}
    for i, j, weight, bias in _blocks(heads):
        tensors[f"blocks.{i}.layers.{j}.weight"] = weight
        tensors[f"blocks.{i}.layers.{j}.bias"] = bias
    tensors["lm_heads.0.weight"] = rows
    if cfg.draft_vocab_size:
        tensors["token_map"] = heads.draft_vocab.to(torch.int64)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": rows.shape[0],
        "medusa_fc_bias": True,
        "original_lm_head": True,
        "max_paths": 64,
        "topk": DEFAULT_TOP_K,
        "torch_dtype": str(rows.dtype).removeprefix("torch."),
        "hf_bpd": _metadata(heads),
    }
    out.mkdir(parents=True, exist_ok=True)
    _save(tensors, out / VLLM_WEIGHTS)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def medusa_choices(rank_probs, tree_size: int) -> list[list[int]]:
    """The tree_size - 1 non-root nodes of highest path probability, as Medusa choices (module docstring).
    `rank_probs [heads][ranks]`: probability that head i's rank-r token is right, non-increasing in r."""
    probs = torch.as_tensor(rank_probs, dtype=torch.float32)
    if probs.dim() != 2 or probs.numel() == 0:
        raise ExportError(f"rank probabilities must be a [heads][ranks] table, got shape {tuple(probs.shape)}")
    if not bool(((probs > 0) & (probs <= 1)).all()):
        raise ExportError("rank probabilities must lie in (0, 1]")
    if probs.shape[1] > 1 and not bool((probs[:, 1:] <= probs[:, :-1]).all()):
        raise ExportError("rank probabilities must not increase with the rank (rank 0 is each head's best token)")
    if tree_size < 1:
        raise ExportError(f"--tree-size must be >= 1 (the root alone), got {tree_size}")
    h, k = probs.shape
    lattice = Lattice(tokens=torch.arange(k).expand(1, h, k), logprobs=probs.log()[None])
    return [list(p.tokens) for p in lattice.best_prefixes(0, tree_size - 1)]


@torch.no_grad()
def heads_rank_probs(heads: BlockDraftHeads, hidden_states: torch.Tensor, top_k: int = DEFAULT_TOP_K) -> list:
    """The heads' own estimate of `rank_probs`: their mean top-k softmax probabilities `[heads][k]` over
    `hidden_states [n, hidden]` (plain heads only)."""
    logits = heads(hidden_states.to(device=heads.device, dtype=heads.dtype)).float()  # [n, h, S]
    top = logits.softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1).values
    return top.mean(0).clamp(min=1e-12).tolist()


@torch.no_grad()
def calibration_hidden_states(model, length: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The base model's last hidden states `[length, hidden]` along its greedy continuation of BOS (token 0
    without one): a sample of the states the heads see, with no data needed."""
    bos = getattr(model.config, "bos_token_id", None)
    start = int(bos[0] if isinstance(bos, list) else bos) if bos is not None else 0
    device = next(model.parameters()).device
    ids = torch.tensor([[start]], device=device)
    seq = model.generate(ids, do_sample=False, max_new_tokens=length, min_new_tokens=length, pad_token_id=start)
    hidden = model(seq[:, :-1], output_hidden_states=True).hidden_states[-1]
    return hidden[0, -length:]


def export_tensorrt_llm_medusa(
    heads: BlockDraftHeads,
    output,
    base_model=None,
    tree_size: int = DEFAULT_TREE_SIZE,
    rank_probs=None,
    top_k: int = DEFAULT_TOP_K,
) -> Path:
    """Write `heads` as TensorRT-LLM's Medusa-heads folder with `medusa_choices` (module docstring) to the
    new folder `output`. `rank_probs` None: the heads' own estimate on the base model's hidden states."""
    check_exportable(heads, "tensorrt-llm-medusa")
    rows = softmax_rows(heads, base_model)
    if rank_probs is None:
        if base_model is None:
            raise ExportError(
                "the Medusa choices need rank probabilities: pass --rank-accuracy FILE or the base model "
                "(--base-model PATH) to estimate them from the heads"
            )
        rank_probs = heads_rank_probs(heads, calibration_hidden_states(base_model), top_k)
    if len(rank_probs) > heads.num_heads:
        raise ExportError(f"rank probabilities for {len(rank_probs)} heads, but the heads have {heads.num_heads}")
    choices = medusa_choices(rank_probs, tree_size)
    out = _fresh_output(output)
    cfg = heads.config
    tensors = {}
    for i, j, weight, bias in _blocks(heads):
        tensors[f"{i}.{j}.linear.weight"] = weight
        tensors[f"{i}.{j}.linear.bias"] = bias
    for i in range(cfg.num_heads):
        tensors[f"{i}.{cfg.num_layers}.weight"] = rows
    config = {
        "medusa_num_heads": cfg.num_heads,
        "num_medusa_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "base_model_name_or_path": cfg.base_model_name,
        "max_draft_len": len(choices),
        "hf_bpd": _metadata(heads),
    }
    out.mkdir(parents=True, exist_ok=True)
    _save(tensors, out / TRTLLM_WEIGHTS)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / TRTLLM_CHOICES).write_text(json.dumps(choices) + "\n")
    return out


def export_heads(heads: BlockDraftHeads, format: str, output, base_model=None, **kwargs) -> Path:
    """Write `heads` in `format` (one of FORMATS) to the new folder `output`."""
    check_exportable(heads, format)
    if format == "vllm-medusa":
        return export_vllm_medusa(heads, output, base_model)
    return export_tensorrt_llm_medusa(heads, output, base_model, **kwargs)


def import_medusa(folder, base_model=None) -> BlockDraftHeads:
    """A vLLM Medusa folder (as `export_vllm_medusa` writes it) as untied `BlockDraftHeads`, bound to
    `base_model` when given (which checks the exported fingerprint). Medusa heads with different softmax
    layers per head have no hf_bpd form (one shared layer) and raise ExportError."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ExportError(f"{folder} is not a Medusa folder (model_type {config.get('model_type')!r})")
    state = load_file(str(folder / VLLM_WEIGHTS))
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    num_heads, num_layers = config["num_heads"], config["num_hidden_layers"]
    truncated = config.get("truncated_vocab_size") or vocab
    if config.get("original_lm_head"):
        rows = state["lm_heads.0.weight"]
    else:
        per_head = [state[f"lm_heads.{i}.weight"] for i in range(num_heads)]
        if any(not torch.equal(w, per_head[0]) for w in per_head[1:]):
            raise ExportError(f"{folder}: the Medusa heads have different softmax layers; hf_bpd heads share one")
        rows = per_head[0]
    token_map = state.get("token_map") if truncated < vocab else None
    if token_map is not None and rows.shape[0] > token_map.numel():  # full rows: the loader takes the map's
        rows = rows[token_map.long()]
    meta = config.get("hf_bpd") or {}
    heads_config = BlockDraftHeadsConfig(
        base_model_name=meta.get("base_model_name", ""),
        base_model_type=meta.get("base_model_type", ""),
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=num_heads,
        num_layers=num_layers,
        tie_lm_head=False,
        base_lm_head_fingerprint=meta.get("base_lm_head_fingerprint"),
        base_lm_head_sketch=meta.get("base_lm_head_sketch"),
        draft_vocab_size=0 if token_map is None else int(token_map.numel()),
    )
    with torch.random.fork_rng(devices=[]):  # every weight is overwritten below
        heads = BlockDraftHeads(heads_config).to(rows.dtype)
    with torch.no_grad():
        for i, head in enumerate(heads.heads):
            for j, block in enumerate(head):
                block.linear.weight.copy_(state[f"blocks.{i}.layers.{j}.weight"])
                bias = state.get(f"blocks.{i}.layers.{j}.bias")
                block.linear.bias.copy_(bias if bias is not None else torch.zeros(hidden))
        heads.lm_head.weight.copy_(rows)
        if token_map is not None:
            heads.draft_vocab.copy_(token_map.long())
    if base_model is not None:
        heads = heads.to(next(base_model.parameters()).device).bind(base_model)
    return heads.eval()


SERVE_HINTS = {
    "vllm-medusa": (
        "vllm serve {base} --speculative-config "
        '\'{{"method": "medusa", "model": "{out}", "num_speculative_tokens": {h}}}\''
    ),
    "tensorrt-llm-medusa": (
        "python examples/medusa/convert_checkpoint.py --model_dir {base} --medusa_model_dir {out} "
        "--output_dir {out}/tllm_checkpoint --dtype float16 --num_medusa_heads {h} --num_medusa_layers {L} "
        "--max_medusa_token_len {n}\n"
        "trtllm-build --checkpoint_dir {out}/tllm_checkpoint --output_dir {out}/engine --gemm_plugin float16\n"
        "python examples/run.py --engine_dir {out}/engine --tokenizer_dir {base} --use_py_session "
        '--temperature 0.0 --medusa_choices "$(cat {out}/medusa_choices.json)"'
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-bpd export", description="Export plain draft heads as Medusa heads for vLLM or TensorRT-LLM."
    )
    parser.add_argument(
        "heads",
        help="saved draft heads (a folder of BlockDraftHeads), or 'packaged-medusa': the hidden-state-only heads "
        "shipped for the packaged SmolLM2",
    )
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True, help="new folder to write")
    parser.add_argument(
        "--base-model",
        help="the base model ('packaged', another packaged model's name, a path or a Hub id): needed for heads "
        "tied to its LM head, and to estimate the "
        "TensorRT-LLM tree's rank probabilities without --rank-accuracy",
    )
    parser.add_argument(
        "--tree-size",
        type=int,
        default=DEFAULT_TREE_SIZE,
        help=f"TensorRT-LLM: nodes of the static tree, root included (default {DEFAULT_TREE_SIZE})",
    )
    parser.add_argument(
        "--rank-accuracy",
        help="TensorRT-LLM: JSON [heads][ranks] of the probability that head i's rank-r token is right",
    )
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="ranks per head the tree may use")
    args = parser.parse_args(argv)

    if args.heads == "packaged-medusa":
        from .packaged import packaged_heads_dir

        args.heads = str(packaged_heads_dir(kind="medusa"))
    heads = BlockDraftHeads.from_pretrained(args.heads).eval()
    try:
        check_exportable(heads, args.format)  # before loading a base model or writing anything
        _fresh_output(args.output)
        base_model = None
        if args.base_model:  # a packaged model's name, a folder or a Hub id
            from .models import load_model

            base_model, _ = load_model(args.base_model, with_tokenizer=False)
        kwargs = {}
        if args.format == "tensorrt-llm-medusa":
            rank_probs = None
            if args.rank_accuracy:
                rank_probs = [row[: args.top_k] for row in json.loads(Path(args.rank_accuracy).read_text())]
            kwargs = {"tree_size": args.tree_size, "rank_probs": rank_probs, "top_k": args.top_k}
        out = export_heads(heads, args.format, args.output, base_model, **kwargs)
    except ExportError as err:
        print(f"hf-bpd export: {err}")
        return 2
    n = len(json.loads((out / TRTLLM_CHOICES).read_text())) if args.format == "tensorrt-llm-medusa" else 0
    print(f"wrote {args.format} heads to {out}")
    hint = SERVE_HINTS[args.format].format(
        base=args.base_model or "BASE_MODEL", out=out, h=heads.num_heads, n=n, L=heads.config.num_layers
    )
    print("serve with (not run here):\n" + hint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
