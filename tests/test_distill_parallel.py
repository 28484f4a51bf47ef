"""`hf-bpd distill` on several processes (torchrun / accelerate launch, 2 CPU processes with gloo, as
tests/test_training.py launches train-heads): the prompts are split with none lost or repeated, the processes
write disjoint shards, the merged dataset is the one-process run's row for row, a partial run resumes, and
(FSDP2 on gloo) a base model sharded over the processes distils the same rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model

from hf_bpd.training import distill

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--prompt-template", "plain", "--seed", "0", "--max-new-tokens", "4", "--batch-size", "2"]
SETTINGS += ["--shard-size", "3", "--no-progress"]


def test_rank_shards_split_every_prompt_once_in_one_process_shards():
    todo = list(range(17))
    one = distill.rank_shards(todo, 4, 7)
    assert [i for i, _ in one] == [7, 8, 9, 10, 11] and [p for _, s in one for p in s] == todo
    for n in (2, 3, 5, 8):
        parts = [distill.rank_shards(todo, 4, 7, r, n) for r in range(n)]
        merged = sorted(shard for part in parts for shard in part)
        assert merged == one  # the same shards under the same names, each in exactly one process
        assert all(i % n == (r + 7) % n for r, part in enumerate(parts) for i, _ in part)
    assert distill.rank_shards([], 4, 0, 1, 2) == []


def test_next_shard_index_passes_a_gap(tmp_path):
    """A shard missing from the middle (a killed process's, or deleted) must not make the next shard overwrite
    the last one, as a count of shards would."""
    rows = {"id": ["a"], "prompt_ids": [[1]], "response_ids": [[2]]}
    assert distill.next_shard_index(tmp_path) == 0
    for i in (0, 1, 2):
        distill.write_shard(tmp_path, rows, i)
    (tmp_path / "shard-00001.parquet").unlink()
    assert distill.write_shard(tmp_path, rows).name == "shard-00003.parquet"


def tiny_model_folder(path: Path) -> Path:
    """A tiny random Llama with a one-character-per-token tokenizer, loadable by `hf-bpd distill --model`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 ?"))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: 4 + i for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tiny_model("llama", eos_token_id=None).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture
def setup(tmp_path):
    """The model folder, a prompt file (13 prompts of different lengths: batches are left-padded), the
    one-process run of all of them and the prompt file."""
    model = tiny_model_folder(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"what is {i} {'x' * (i % 5)}?"} for i in range(13)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", str(model), "--prompts", str(prompts), *SETTINGS]
    assert distill.main(common + ["--output", str(tmp_path / "one"), "--device", "cpu"]) == 0
    return common, datasets.load_from_disk(str(tmp_path / "one" / "dataset")), prompts


def launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`hf-bpd distill` on 2 CPU processes, launched the way tests/test_training.py launches train-heads."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "hf_bpd.training.distill", *args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def shard_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "shards").glob("shard-*.parquet"))


def test_two_processes_distill_the_one_process_rows_and_resume(setup, tmp_path):
    common, one, prompts = setup
    out = tmp_path / "two"
    done = launch(common + ["--output", str(out)])
    assert done.stdout.count("distilled 13 prompts on 2 processes") == 1  # the main process alone reports
    # 13 prompts in shards of 3: shards 0, 2, 4 from process 0, 1 and 3 from process 1, each written once
    assert shard_names(out) == [f"shard-{i:05d}.parquet" for i in range(5)]
    two = datasets.load_from_disk(str(out / "dataset"))
    assert two.to_dict() == one.to_dict()  # the same rows in the same order (the same shards and batches)
    assert json.loads((out / "manifest.json").read_text())["num_prompts"] == 13

    # a killed run: process 1 died before writing shard 1, process 0 before writing its last shard (4)
    part = tmp_path / "part"
    shutil.copytree(out, part)
    for name in ("shard-00001.parquet", "shard-00004.parquet"):
        (part / "shards" / name).unlink()
    shutil.rmtree(part / "dataset")
    left = [pid for pid, _ in distill.load_prompts(str(prompts), "prompt", "id", None, seed=0)]
    left = left[3:6] + left[12:]
    assert distill.done_ids(part / "shards") == set(one["id"]) - set(left)
    launch(common + ["--output", str(part)])
    resumed = datasets.load_from_disk(str(part / "dataset")).to_dict()  # read now: the rerun below rewrites it
    assert sorted(resumed["id"]) == sorted(one["id"]) and len(resumed["id"]) == 13  # none lost, none repeated
    by_id = {r["id"]: (r["prompt_ids"], r["response_ids"]) for r in one}
    rows = zip(resumed["id"], resumed["prompt_ids"], resumed["response_ids"])
    assert all(by_id[pid] == (prompt, response) for pid, prompt, response in rows)  # as one process distils them
    assert distill.data_digest(resumed) == distill.data_digest(one)
    # the 3 finished shards kept; the 4 prompts left cut into shards 4 (process 0) and 5 (process 1)
    assert shard_names(part) == [f"shard-{i:05d}.parquet" for i in (0, 2, 3, 4, 5)]
    # a rerun of a finished run, on one process, generates nothing and writes the same dataset
    assert distill.main(common + ["--output", str(part), "--device", "cpu"]) == 0
    assert shard_names(part) == [f"shard-{i:05d}.parquet" for i in (0, 2, 3, 4, 5)]
    assert datasets.load_from_disk(str(part / "dataset")).to_dict() == resumed


def test_base_model_sharded_with_fsdp_distills_the_same_rows(setup, tmp_path):
    """FSDP2 on gloo: each process holds half of every weight; the processes' unequal numbers of batches
    (5 and 4) are evened out by a dummy `generate`, or the all-gathers would hang."""
    common, one, _ = setup
    out = tmp_path / "fsdp"
    done = launch(common + ["--output", str(out)], env={"ACCELERATE_USE_FSDP": "true"})
    assert done.stdout.count("distilled 13 prompts on 2 processes, the model sharded with FSDP,") == 1
    assert datasets.load_from_disk(str(out / "dataset")).to_dict() == one.to_dict()
