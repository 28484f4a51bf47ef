"""Self-distillation data: the base model's own greedy answers to a prompt set.

Heads trained on what the base model itself says accept far more than heads trained on human text (the
Medusa/EAGLE lesson). The recipe is fully determined by the command line (greedy decoding, prompt format,
sorted batching) and recorded in `manifest.json`, so the data is reproducible.

Prompt format (`--prompt-template`): an instruct model's prompts go through its chat template ("chat", the
default). A base model has none, and what its users see is its continuation of plain text: "qa" frames each
prompt as "Question: {prompt}\nAnswer:" (the simplest framing under which a base model answers rather than
continues the question), "plain" gives the prompt text alone, and any other value containing "{prompt}" is
used as the template itself. The text is tokenized with the tokenizer's own special tokens (Gemma's <bos>).

Output folder:
  shards/shard-XXXXX.parquet   written atomically as batches finish: {id, prompt_ids, response_ids}
  manifest.json                model, prompt file, arguments, library versions
  dataset/                     `datasets.Dataset.save_to_disk` of all shards (written at the end)
Interrupt it at any time; rerunning the same command skips every prompt already in a shard.

Several processes (`accelerate launch --num_processes N -m hf_bpd.training.distill ...` on GPUs; on CPUs
`ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m hf_bpd.training.distill ...`, as accelerate launch
starts one CPU process unless given MPI): the prompts not yet in a shard are cut into shards of
`--shard-size` in the seeded order, exactly as one process cuts them, and shard k goes to process k mod N
(`rank_shards`). Shard names are fixed before any process
writes (the next free index + k), so processes never write the same file, and each shard holds the same
prompts in the same batches as in a one-process run: the merged `dataset/` (shards in name order) is the
one-process run's, row for row and in the same order (a batch's left padding cannot make it differ, since
the batches are the same). Every process checks `manifest.json`; the main process alone rewrites it and,
after every process has finished, writes `dataset/`. A killed run resumes with any number of processes:
finished shards are skipped and the rest is cut again (a resumed run's rows, like a resumed one-process
run's, can come in another order and batches than an uninterrupted run's; `data_digest` does not depend on
the order). Several nodes need `--output` on a file system they share.

`--fsdp` (or an accelerate config with `distributed_type: FSDP`, e.g. training/accelerate/fsdp.yaml) shards
the frozen base model over the processes with FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per
decoder layer) for a model that does not fit one device: every process still distils its own prompts, and
all of them run the same number of `generate` calls (with `synced_gpus`) so that the parameter all-gathers
stay matched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import PROMPT_FORMATS

DEFAULT_PROMPTS = "../shared/data/train_prompts.jsonl"
CHAT = "chat"
_CHAT_DECODING = "greedy, chat template with generation prompt"


def resolve_prompt_template(template: str) -> str:
    """`chat`, or the template string a prompt format names (`plain`, `qa`, or a template with {prompt})."""
    if template == CHAT:
        return CHAT
    template = PROMPT_FORMATS.get(template, template)
    if "{prompt}" not in template:
        raise ValueError(
            f"prompt template {template!r} is neither 'chat', one of {sorted(PROMPT_FORMATS)}, "
            "nor a template containing {prompt}"
        )
    return template


def decoding_description(template: str) -> str:
    """The manifest's `decoding` entry (the chat one unchanged from manifests written before templates)."""
    template = resolve_prompt_template(template)
    if template == CHAT:
        return _CHAT_DECODING
    return f"greedy, prompt template {template!r} tokenized with the tokenizer's special tokens, no chat template"


def encode_prompt(tokenizer, prompt: str, template: str = CHAT, max_prompt_tokens: int = 512) -> list[int]:
    """Token ids of `prompt` in the given format, keeping the last `max_prompt_tokens` (the question's end and
    the generation prompt). A template's leading <bos> survives that cut: a model such as Gemma degrades
    without it. (The chat path is unchanged from before templates existed: recorded data stays reproducible.)"""
    template = resolve_prompt_template(template)
    if template == CHAT:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return ids[-max_prompt_tokens:]
    ids = list(tokenizer(template.replace("{prompt}", prompt), add_special_tokens=True)["input_ids"])
    if len(ids) <= max_prompt_tokens:
        return ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[0] == bos and max_prompt_tokens > 1:
        return [bos] + ids[-(max_prompt_tokens - 1) :]
    return ids[-max_prompt_tokens:]


def load_prompts(
    source: str, column: str, id_column: str | None, limit: int | None, seed: int | None = 0, offset: int = 0
) -> list[tuple[str, str]]:
    """(id, prompt) pairs from a jsonl file, a `save_to_disk` folder or a Hub dataset name, shuffled with
    `seed` (None keeps file order) before `offset` and `limit`: prompt files are often grouped by task.
    `offset` skips the first prompts of that order (another run closed with `--limit offset` has them),
    so a prompt set can be distilled in disjoint runs without changing the earlier ones."""
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError(f"offset and limit must be >= 0, got offset={offset}, limit={limit}")
    if source.endswith((".jsonl", ".json")) and Path(source).is_file():
        rows = read_jsonl(source)
    elif Path(source).is_dir():
        from datasets import load_from_disk

        rows = list(load_from_disk(source))
    else:
        from datasets import load_dataset

        rows = list(load_dataset(source, split="train"))
    if rows and column not in rows[0]:
        raise ValueError(f"prompt column `{column}` not in {source}; columns: {sorted(rows[0])}")
    out = [(str(r[id_column]) if id_column and id_column in r else str(i), r[column]) for i, r in enumerate(rows)]
    if seed is not None:
        import random

        random.Random(seed).shuffle(out)
    if offset > len(out):
        raise ValueError(f"offset {offset} is past the {len(out)} prompts of {source}")
    out = out[offset:]
    return out[:limit] if limit else out


def load_distilled(path: str | Path | list[str | Path]):
    """A distilled dataset: `hf-bpd distill --output X` given as X (its `dataset/`, or while a run is
    still going, its finished shards) or as X/dataset. Several paths: their rows one after the other
    (`{id, prompt_ids, response_ids}` only), in the order given."""
    from datasets import concatenate_datasets, load_dataset, load_from_disk

    if isinstance(path, (list, tuple)):
        parts = [load_distilled(p) for p in path]
        if len(parts) == 1:
            return parts[0]
        columns = ["id", "prompt_ids", "response_ids"]
        return concatenate_datasets([d.select_columns(columns) for d in parts])
    path = Path(path)
    if (path / "dataset").is_dir() and not _more_shards_than_dataset(path):
        return load_from_disk(str(path / "dataset"))
    if (path / "shards").is_dir():
        shards = sorted(str(p) for p in (path / "shards").glob("shard-*.parquet"))
        if not shards:
            raise FileNotFoundError(f"{path}/shards holds no finished shard yet")
        return load_dataset("parquet", data_files=shards, split="train")
    return load_from_disk(str(path))


def data_digest(data) -> dict:
    """What a distilled dataset holds, to check a rerun of the recipe against a record of it: its number
    of samples and response tokens, and a sha256 over its rows sorted by id (independent of shard order
    and batching, changed by any token). Greedy decoding in float32 on the same torch build gives the same
    rows; a different kernel may flip a near-tie, which the digest then shows."""
    import hashlib

    rows = sorted(zip(data["id"], data["prompt_ids"], data["response_ids"]))
    digest = hashlib.sha256()
    for pid, prompt, response in rows:
        digest.update(json.dumps([pid, list(prompt), list(response)]).encode() + b"\n")
    return {
        "num_samples": len(rows),
        "num_response_tokens": sum(len(r) for _, _, r in rows),
        "sha256": digest.hexdigest(),
    }


def _more_shards_than_dataset(path: Path) -> bool:
    """A run grown with a larger --limit and not finished yet: its shards hold more than dataset/."""
    import pyarrow.parquet as pq
    from datasets import load_from_disk

    shards = sorted((path / "shards").glob("shard-*.parquet"))
    return sum(pq.read_metadata(s).num_rows for s in shards) > len(load_from_disk(str(path / "dataset")))


def done_ids(shard_dir: Path) -> set[str]:
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for shard in sorted(shard_dir.glob("shard-*.parquet")):
        ids.update(pq.read_table(shard, columns=["id"]).column("id").to_pylist())
    return ids


def next_shard_index(shard_dir: Path) -> int:
    """One past the highest shard index in `shard_dir` (not their count: a shard deleted from the middle, or
    one a killed process never wrote, must not make the next shard overwrite a finished one)."""
    indices = []
    for shard in shard_dir.glob("shard-*.parquet"):
        try:
            indices.append(int(shard.stem[len("shard-") :]))
        except ValueError:
            continue
    return max(indices, default=-1) + 1


def write_shard(shard_dir: Path, rows: dict[str, list], index: int | None = None) -> Path:
    """Atomically write shard `index` (default: the next free one) as tmp file + rename: an interrupted write
    leaves no partial shard, and processes writing other indices never touch the same file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if index is None:
        index = next_shard_index(shard_dir)
    path = shard_dir / f"shard-{index:05d}.parquet"
    tmp = shard_dir / f".tmp-{index:05d}-{os.getpid()}.parquet"
    pq.write_table(pa.table(rows), tmp)
    os.replace(tmp, path)
    return path


def rank_shards(todo: list, shard_size: int, first_index: int, rank: int = 0, num_processes: int = 1) -> list:
    """This process's `(shard index, prompts)`: `todo` cut into shards of `shard_size` in order, shard k
    named `first_index + k` and distilled by process k mod `num_processes`. One process gets every shard,
    so N processes write exactly the shards one process would, each by one of them."""
    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    shards = [todo[s : s + shard_size] for s in range(0, len(todo), shard_size)]
    return [(first_index + k, shard) for k, shard in enumerate(shards) if k % num_processes == rank]


def _num_batches(shards: list, batch_size: int) -> int:
    return sum(-(-len(shard) // batch_size) for _, shard in shards)


class _OneProcess:
    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


def distill(
    model,
    tokenizer,
    prompts: list[tuple[str, str]],
    output: Path,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    batch_size: int = 16,
    shard_size: int = 64,
    progress: bool = True,
    prompt_template: str = CHAT,
    state=None,
    lockstep: bool = False,
) -> Path:
    """Generate greedy responses for every prompt not yet in `output/shards`, then write `output/dataset`.
    `prompt_template`: "chat" (the tokenizer's chat template), "plain", "qa" or a template with {prompt}.
    `state`: this process's `accelerate.PartialState` when several processes distil together (each calls
    this with the same arguments; it distils its `rank_shards`); None for one process. `lockstep`: every
    process runs the same number of `generate` calls, each with `synced_gpus` (a model sharded with FSDP,
    whose every forward is a collective); a process out of prompts runs dummy one-token batches."""
    import torch
    from datasets import concatenate_datasets, load_dataset
    from tqdm import tqdm

    state = state if state is not None else _OneProcess()
    shard_dir = output / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    finished = done_ids(shard_dir)
    first_index = next_shard_index(shard_dir)
    # every process has read the same finished shards before any of them writes one
    state.wait_for_everyone()
    todo = [(i, p) for i, p in prompts if i not in finished]
    mine = rank_shards(todo, shard_size, first_index, state.process_index, state.num_processes)
    calls = _num_batches(mine, batch_size)
    if lockstep:
        everyone = range(state.num_processes)
        calls = max(
            _num_batches(rank_shards(todo, shard_size, first_index, r, state.num_processes), batch_size)
            for r in everyone
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    device = next(model.parameters()).device
    show = progress and state.is_main_process
    desc = "distill" if state.num_processes == 1 else f"distill (process 0 of {state.num_processes})"
    total = len(prompts) if state.num_processes == 1 else sum(len(shard) for _, shard in mine)
    initial = total - len(todo) if state.num_processes == 1 else 0
    bar = tqdm(total=total, initial=initial, disable=not show, desc=desc)

    def greedy(input_ids, mask):
        with torch.no_grad():
            return model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                **({"synced_gpus": True} if lockstep else {}),
            )

    # Shards in the seeded order; inside a shard, batches of similar length waste less compute on padding.
    for index, shard in mine:
        encoded = [(pid, encode_prompt(tokenizer, prompt, prompt_template, max_prompt_tokens)) for pid, prompt in shard]
        chunk = sorted(encoded, key=lambda r: len(r[1]))
        rows: dict[str, list] = {"id": [], "prompt_ids": [], "response_ids": []}
        for b in range(0, len(chunk), batch_size):
            batch = chunk[b : b + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
            out = greedy(input_ids, mask)
            calls -= 1
            for (pid, ids), seq in zip(batch, out[:, width:].tolist()):
                response = []
                for tok in seq:
                    response.append(tok)
                    if tok in eos:
                        break
                rows["id"].append(pid)
                rows["prompt_ids"].append(ids)
                rows["response_ids"].append(response)
            bar.update(len(batch))
        write_shard(shard_dir, rows, index)
    for _ in range(calls):  # lockstep: as many generate calls as the busiest process (their output unused)
        greedy(torch.tensor([[pad]], device=device), torch.ones(1, 1, dtype=torch.long, device=device))
    bar.close()
    state.wait_for_everyone()  # every shard is written
    if state.is_main_process:
        shards = sorted(str(p) for p in shard_dir.glob("shard-*.parquet"))
        data = concatenate_datasets([load_dataset("parquet", data_files=shards, split="train")])
        keep = {pid for pid, _ in prompts}
        data = data.filter(lambda r: r["id"] in keep)
        data.save_to_disk(str(output / "dataset"))
    state.wait_for_everyone()  # dataset/ is written before any process returns it
    return output / "dataset"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd distill", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="packaged",
        help="model path, 'packaged' (SmolLM2-135M-Instruct) or another packaged model ('gemma-3-270m')",
    )
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="jsonl file, save_to_disk folder or Hub dataset")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--output", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed applied before --limit; -1 keeps file order")
    parser.add_argument(
        "--offset", type=int, default=0, help="skip the first N prompts of the seeded order (another run's --limit N)"
    )
    parser.add_argument(
        "--prompt-template",
        default=CHAT,
        help="how a prompt becomes the model's input: 'chat' (the chat template, for instruct models), 'qa' "
        "(\"Question: {prompt}\\nAnswer:\", for base models), 'plain' (the prompt text alone) or a template "
        "containing {prompt}",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument(
        "--device",
        default=None,
        help="default: this process's device under accelerate launch / torchrun (cuda:<local rank>), else cuda if "
        "available, else cpu",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the base model over the processes with FSDP2 (a model too large for one device; implied by "
        "ACCELERATE_USE_FSDP=true, which `accelerate launch --config_file training/accelerate/fsdp.yaml` sets)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        template = resolve_prompt_template(args.prompt_template)
    except ValueError as err:
        parser.error(str(err))
    if args.prompts == DEFAULT_PROMPTS and not Path(DEFAULT_PROMPTS).exists():
        raise SystemExit(
            f"the default prompts {DEFAULT_PROMPTS} exist only beside the project's checkout: pass --prompts "
            "(a jsonl file, a save_to_disk folder or a Hub dataset; this repository ships "
            "training/data/instructions.jsonl)"
        )

    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from hf_bpd.io.models import load_model

    # under accelerate launch / torchrun: one process of several (gloo on CPU with ACCELERATE_USE_CPU=true)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    fsdp = args.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP")
    if fsdp and state.num_processes < 2:
        raise SystemExit("--fsdp shards the model over several processes: launch them with accelerate or torchrun")
    device = args.device or (str(state.device) if state.num_processes > 1 else "cuda" if _cuda() else "cpu")
    # a sharded model is loaded on the host, and each process keeps its shard of it on its device
    model, tokenizer = load_model(args.model, dtype=args.dtype, device="cpu" if fsdp else device)
    if fsdp:
        model = shard_model(model, device, state.num_processes)
    prompts = load_prompts(
        args.prompts, args.prompt_column, args.id_column, args.limit, None if args.seed < 0 else args.seed, args.offset
    )
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    manifest = {
        "model": args.model,
        "model_name": getattr(model.config, "_name_or_path", ""),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "seed": args.seed,
        "offset": args.offset,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "prompt_template": template,
        "decoding": decoding_description(template),
        "versions": _versions(),
    }
    previous = output / "manifest.json"
    if previous.is_file():  # resuming: the recipe must be the same, or the data would mix two recipes
        old = json.loads(previous.read_text())
        # --limit may change: the seeded order is fixed, so a run of N prompts is a prefix of a run of M > N.
        old.setdefault("offset", 0)  # manifests written before --offset existed
        old.setdefault("prompt_template", CHAT)  # and before --prompt-template
        changed = [k for k in manifest if k not in ("versions", "num_prompts") and old.get(k) != manifest[k]]
        if changed:  # every process checks, so every process stops
            raise SystemExit(
                f"{output} was distilled with another recipe ({', '.join(changed)} differ): "
                "use a new --output or the same arguments"
            )
    state.wait_for_everyone()  # every process has read the manifest before it is rewritten
    if state.is_main_process:
        tmp = output / f".manifest-{os.getpid()}.json"
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, previous)
    path = distill(
        model,
        tokenizer,
        prompts,
        output,
        args.max_new_tokens,
        args.max_prompt_tokens,
        args.batch_size,
        args.shard_size,
        progress=not args.no_progress,
        prompt_template=template,
        state=state,
        lockstep=fsdp,
    )
    if state.is_main_process:
        summary = data_digest(load_distilled(output))
        processes = f" on {state.num_processes} processes" if state.num_processes > 1 else ""
        processes += ", the model sharded with FSDP," if fsdp else ""
        print(f"distilled {len(prompts)} prompts{processes} into {path}: {json.dumps(summary)}")
    return 0


def shard_model(model, device: str, num_processes: int):
    """`model` sharded over the processes with FSDP2: one unit per decoder layer (the model's
    `_no_split_modules`), the rest (embeddings, final norm, LM head) in the root unit. Each forward
    all-gathers one unit at a time: a process holds its 1/N of the weights, and in full the root unit and
    about two layers (the one running and the one prefetched)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (num_processes,))
    layers = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in layers]
    if not units:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    for module in units:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import hf_bpd

    return {"hf_bpd": hf_bpd.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


if __name__ == "__main__":
    sys.exit(main())
