"""`hf-bpd train-rescorer`: the small causal LM of `NeuralRescorer` (local rescoring, paper Alg. 2).

It must share the base model's tokenizer. Default: the base model's first `--num-layers` layers with its
embeddings, final norm and (tied) output head (`hf_bpd.drafting.rescoring.neural.truncated_lm`), fine-tuned on the
distilled data (prompt + the base model's own response) to predict the next token. The embeddings and
head stay frozen, so training updates the few layers only and the output logits live in the base
model's space. Any Hub causal LM with the same tokenizer can be passed to `NeuralRescorer` instead.

Output: the fine-tuned layers only (fp16 `layers.safetensors` + `truncated_lm.json`, a few MB: the
embeddings are the base model's), rebuilt on the base model by `NeuralRescorer.from_pretrained` when the
drafter binds it; + training_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from hf_bpd.training.objective import IGNORE, length_sorted_batches, right_padded


def lm_batches(data, batch_tokens: int, seed: int) -> list[list[dict]]:
    """Length-sorted batches of at most `batch_tokens` padded tokens, in shuffled order."""
    batches = [[data[j] for j in batch] for batch in length_sorted_batches(data, batch_tokens)]
    random.Random(seed).shuffle(batches)
    return batches


def load_init(model, path: str):
    """Continue from a saved rescorer: a `save_truncated_lm` folder or a full model folder."""
    from transformers import AutoModelForCausalLM

    from hf_bpd.drafting.rescoring.neural import TRUNCATED_LM_CONFIG, load_truncated_lm

    if (Path(path) / TRUNCATED_LM_CONFIG).is_file():
        return load_truncated_lm(model, path).float()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def lm_loss(lm, rows) -> torch.Tensor:
    _, ids, mask = right_padded(rows)
    labels = ids.masked_fill(mask == 0, IGNORE)
    return lm(input_ids=ids, attention_mask=mask, labels=labels).loss


def train_rescorer(
    model,
    data,
    num_layers: int = 2,
    init: str | None = None,
    epochs: int = 1,
    lr: float = 5e-4,
    batch_tokens: int = 4096,
    val_fraction: float = 0.05,
    seed: int = 0,
    progress: bool = True,
    on_epoch=None,
):
    from tqdm import tqdm

    from hf_bpd.drafting.rescoring.neural import truncated_lm

    torch.manual_seed(seed)
    lm = truncated_lm(model, num_layers).float() if init is None else load_init(model, init)
    lm.get_input_embeddings().weight.requires_grad_(False)
    lm.get_output_embeddings().weight.requires_grad_(False)
    rows = list(data)
    random.Random(seed).shuffle(rows)
    n_val = max(1, int(len(rows) * val_fraction))
    val, train = rows[:n_val], rows[n_val:]
    params = [p for p in lm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def validate() -> float:
        lm.eval()
        with torch.no_grad():
            losses = [float(lm_loss(lm, b)) for b in lm_batches(val, batch_tokens, 0)]
        lm.train()
        return sum(losses) / len(losses)

    history = [{"epoch": 0, "val_loss": validate()}]
    for epoch in range(1, epochs + 1):
        t0 = time.time()
        batches = lm_batches(train, batch_tokens, seed + epoch)
        total = 0.0
        lm.train()
        for batch in tqdm(batches, disable=not progress, desc=f"epoch {epoch}"):
            loss = lm_loss(lm, batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            total += loss.item()
        history.append(
            {
                "epoch": epoch,
                "train_loss": total / len(batches),
                "val_loss": validate(),
                "seconds": round(time.time() - t0, 1),
            }
        )
        print(json.dumps(history[-1]))
        if on_epoch is not None:
            on_epoch(lm, history)  # checkpoint: an interrupted run keeps its finished epochs
    for entry in history:
        entry["val_perplexity"] = round(math.exp(entry["val_loss"]), 2)
    return lm.eval(), history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd train-rescorer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged", help="base model path or 'packaged'")
    parser.add_argument("--data", required=True, help="hf-bpd distill --output folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--init", default=None, help="continue from a saved rescorer folder")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from hf_bpd.drafting.rescoring.neural import save_truncated_lm
    from hf_bpd.io.models import load_model
    from hf_bpd.training.distill import load_distilled

    model, _ = load_model(args.model)

    out = Path(args.output)

    def save(lm, history) -> None:
        save_truncated_lm(lm, out, model)
        (out / "training_log.json").write_text(json.dumps({"args": vars(args), "epochs": history}, indent=2))

    lm, history = train_rescorer(
        model,
        load_distilled(args.data),
        num_layers=args.num_layers,
        init=args.init,
        epochs=args.epochs,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        progress=not args.no_progress,
        on_epoch=save,
    )
    save(lm, history)
    print(f"saved rescorer LM to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
