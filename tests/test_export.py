"""`hf-bpd export`: names and shapes against what vLLM's and TensorRT-LLM's Medusa loaders read, the loaders'
forward passes (re-written here from their source) giving the heads' own logits, the import round trip
(equal logits, identical decoding), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import random_heads, tiny_model
from safetensors.torch import load_file

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.cli import main as cli_main
from hf_bpd.io.export import (
    ExportError,
    export_heads,
    export_tensorrt_llm_medusa,
    export_vllm_medusa,
    import_medusa,
    medusa_choices,
)


def vllm_expects(config: dict) -> dict[str, tuple[int, ...]]:
    """What vLLM 0.11.0's `Medusa` (vllm/model_executor/models/medusa.py) loads for this config: its
    named parameters (ResidualBlock Linears with bias only under `medusa_fc_bias`; one shared `lm_head`
    read from `lm_heads.0.weight` under `original_lm_head`, else `lm_heads.{i}`) and `token_map` (required
    by the loader's closing assert when truncated_vocab_size < vocab_size)."""
    h, layers, hidden = config["num_heads"], config["num_hidden_layers"], config["hidden_size"]
    vocab = config["vocab_size"]
    truncated = config.get("truncated_vocab_size") or vocab  # MedusaConfig: None -> vocab_size
    out = {}
    for i in range(h):
        for j in range(layers):
            out[f"blocks.{i}.layers.{j}.weight"] = (hidden, hidden)
            if config.get("medusa_fc_bias", False):
                out[f"blocks.{i}.layers.{j}.bias"] = (hidden,)
    for i in range(1 if config.get("original_lm_head", False) else h):
        out[f"lm_heads.{i}.weight"] = (truncated, hidden)
    if truncated < vocab:
        out["token_map"] = (truncated,)
    return out


def trtllm_expects(config: dict) -> dict[str, tuple[int, ...]]:
    """What TensorRT-LLM's `load_medusa_hf` (tensorrt_llm/models/medusa/weight.py) reads from
    medusa_lm_head.safetensors: per head and layer `{h}.{l}.linear.weight/bias`, and the head's LM head
    `{h}.{num_layers}.weight` over the whole vocabulary."""
    h, layers = config["medusa_num_heads"], config["medusa_num_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    out = {}
    for i in range(h):
        for j in range(layers):
            out[f"{i}.{j}.linear.weight"] = (hidden, hidden)
            out[f"{i}.{j}.linear.bias"] = (hidden,)
        out[f"{i}.{layers}.weight"] = (vocab, hidden)
    return out


def vllm_logits(folder, x: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa forward + compute_logits, from its source: per head, the residual blocks
    `x + SiLU(layer(x))`, the (shared) LM head, and the truncated logits scattered into a -inf row of the
    full vocabulary through token_map. `[n, hidden] -> [n, h, vocab]`."""
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    out = []
    for i in range(config["num_heads"]):
        y = x
        for j in range(config["num_hidden_layers"]):
            bias = state.get(f"blocks.{i}.layers.{j}.bias") if config.get("medusa_fc_bias") else None
            y = y + F.silu(F.linear(y, state[f"blocks.{i}.layers.{j}.weight"], bias))
        lm = state["lm_heads.0.weight" if config.get("original_lm_head") else f"lm_heads.{i}.weight"]
        logits = F.linear(y, lm)
        if config["truncated_vocab_size"] < config["vocab_size"]:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., state["token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out, dim=-2)


def full_vocab_logits(heads: BlockDraftHeads, x: torch.Tensor) -> torch.Tensor:
    logits = heads(x)
    if not heads.config.draft_vocab_size:
        return logits
    full = torch.full((*logits.shape[:-1], heads.config.vocab_size), -torch.inf)
    full[..., heads.draft_vocab] = logits
    return full


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def draft_vocab(n: int = 40) -> torch.Tensor:
    return torch.randperm(97, generator=torch.Generator().manual_seed(3))[:n]


HEAD_KINDS = {
    "tied": dict(),
    "tied-draft-vocab": dict(draft_vocab=draft_vocab()),
    "untied": dict(tie_lm_head=False),
    "untied-draft-vocab-2-layers": dict(tie_lm_head=False, draft_vocab=draft_vocab(), num_layers=2),
}


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_vllm_folder_has_the_names_and_shapes_vllm_loads(model, tmp_path, kind):
    heads = random_heads(model, num_heads=3, **HEAD_KINDS[kind])
    out = export_vllm_medusa(heads, tmp_path / "medusa", model)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"]) == (32, 97)
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, heads.config.num_layers)
    assert config["truncated_vocab_size"] == (heads.config.draft_vocab_size or 97)
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads"/"layers": only ours may
    assert {k for k in config if "num" in k and ("heads" in k or "layers" in k)} == {"num_heads", "num_hidden_layers"}
    state = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == vllm_expects(config)
    if "token_map" in state:
        assert not state["token_map"].is_floating_point()
        assert torch.equal(state["token_map"], heads.draft_vocab)
    x = torch.randn(5, 32)
    with torch.no_grad():
        # the loader's own arithmetic (other op order, other matmul blocking per thread count): equal up
        # to float rounding; the round trip below reloads the weights and compares outputs exactly
        torch.testing.assert_close(vllm_logits(out, x), full_vocab_logits(heads, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_import_gives_equal_logits(model, tmp_path, kind):
    heads = random_heads(model, num_heads=3, **HEAD_KINDS[kind])
    out = export_vllm_medusa(heads, tmp_path / "medusa", model)
    for base in (None, model):
        back = import_medusa(out, base)
        assert back.config.draft_vocab_size == heads.config.draft_vocab_size
        assert torch.equal(back.draft_vocab, heads.draft_vocab)
        x = torch.randn(2, 4, 32)
        with torch.no_grad():
            assert torch.equal(back(x), heads(x))
    back.save_pretrained(tmp_path / "saved")  # an ordinary hf_bpd checkpoint from then on
    with torch.no_grad():
        assert torch.equal(BlockDraftHeads.from_pretrained(tmp_path / "saved")(x), heads(x))


@pytest.mark.parametrize("kind", ["tied", "tied-draft-vocab"])
def test_imported_heads_decode_identically(model, tmp_path, kind):
    heads = random_heads(model, num_heads=3, **HEAD_KINDS[kind])
    back = import_medusa(export_vllm_medusa(heads, tmp_path / "medusa", model), model)
    settings = dict(top_k=4, max_tree_tokens=8, calibrate=False, packed_linear=False, context_lookup=0)
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    runs = []
    for h in (heads, back):
        drafter = BlockDrafter(h, **settings)
        out = model.generate(
            ids, do_sample=False, max_new_tokens=30, custom_generate=hf_bpd.generate, assistant=drafter
        )
        runs.append((out, drafter.stats.accepted_lengths, drafter.stats.tree_sizes))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:]  # the same drafts accepted step by step, not only the same text
    assert torch.equal(runs[0][0], model.generate(ids, do_sample=False, max_new_tokens=30))


@pytest.mark.parametrize("kind", ["tied", "untied-2-layers"])
def test_tensorrt_llm_folder_has_the_names_and_shapes_its_loader_reads(model, tmp_path, kind):
    extra = dict(tie_lm_head=False, num_layers=2) if kind != "tied" else {}
    heads = random_heads(model, num_heads=3, **extra)
    out = export_tensorrt_llm_medusa(heads, tmp_path / "trt", model, tree_size=12)
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == config["num_medusa_heads"] == 3
    assert config["medusa_num_layers"] == heads.config.num_layers
    state = load_file(str(out / "medusa_lm_head.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == trtllm_expects(config)
    # TensorRT-LLM's MedusaHead: layers x + silu(linear(x)), then lm_head (model.py)
    x = torch.randn(6, 32)
    layers = config["medusa_num_layers"]
    for i in range(3):
        y = x
        for j in range(layers):
            y = y + F.silu(F.linear(y, state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"]))
        with torch.no_grad():
            torch.testing.assert_close(F.linear(y, state[f"{i}.{layers}.weight"]), heads(x)[:, i], rtol=1e-5, atol=1e-5)
    choices = json.loads((out / "medusa_choices.json").read_text())
    assert len(choices) == config["max_draft_len"] == 11
    assert_tree(choices, num_heads=3, top_k=10)


def assert_tree(choices, num_heads, top_k):
    seen = set()
    for c in choices:
        assert 1 <= len(c) <= num_heads and all(0 <= r < top_k for r in c)
        assert len(c) == 1 or tuple(c[:-1]) in seen  # every prefix comes first: a tree
        assert tuple(c) not in seen
        seen.add(tuple(c))


def test_medusa_choices_are_the_nodes_of_highest_path_probability():
    probs = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]
    # nodes by product: [0] .6, [0,0] .3, [1] .2, [0,1] .18, [2] .1, [1,0] .1, [0,2] .06 ...
    assert medusa_choices(probs, 1) == []
    assert medusa_choices(probs, 5) == [[0], [0, 0], [1], [0, 1]]
    everything = medusa_choices(probs, 100)
    assert len(everything) == 3 + 9  # every node of the 2-deep, 3-wide lattice
    assert_tree(everything, 2, 3)
    with pytest.raises(ExportError, match="increase"):
        medusa_choices([[0.2, 0.5]], 4)


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(token_input="next"), "token_input='next'"),
        (dict(token_input="previous"), "token_input='previous'"),
        (dict(token_input="previous", copy_dim=8), "copy_dim=8"),
    ],
)
@pytest.mark.parametrize("format", ["vllm-medusa", "tensorrt-llm-medusa"])
def test_heads_that_read_more_than_the_hidden_state_are_refused(model, tmp_path, kw, why, format):
    heads = random_heads(model, num_heads=2, **kw)
    with pytest.raises(ExportError, match=why):
        export_heads(heads, format, tmp_path / "out", model, rank_probs=[[0.5], [0.4]])
    assert not (tmp_path / "out").exists()


def test_missing_inputs_are_refused_before_writing(model, tmp_path):
    tied = random_heads(model, num_heads=2)
    with pytest.raises(ExportError, match="--base-model"):
        export_vllm_medusa(tied, tmp_path / "a")
    with pytest.raises(ExportError, match="draft vocabulary"):
        export_tensorrt_llm_medusa(random_heads(model, num_heads=2, draft_vocab=draft_vocab()), tmp_path / "b", model)
    untied = random_heads(model, num_heads=2, tie_lm_head=False)
    with pytest.raises(ExportError, match="--rank-accuracy"):
        export_tensorrt_llm_medusa(untied, tmp_path / "c")
    with pytest.raises(ValueError, match="fingerprint"):
        export_vllm_medusa(tied, tmp_path / "d", tiny_model(seed=1))
    assert not any((tmp_path / n).exists() for n in "abcd")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_vllm_medusa(untied, tmp_path / "e")


def test_cli_exports_both_formats(model, tmp_path, capsys):
    heads = random_heads(model, num_heads=3)
    heads.save_pretrained(tmp_path / "heads")
    model.save_pretrained(tmp_path / "base")
    assert (
        cli_main(["export", str(tmp_path / "heads"), "--format", "vllm-medusa", "--output", str(tmp_path / "v")]) == 2
    )
    assert "--base-model" in capsys.readouterr().out and not (tmp_path / "v").exists()
    base = ["--base-model", str(tmp_path / "base")]
    args = ["export", str(tmp_path / "heads"), "--format", "vllm-medusa", "--output", str(tmp_path / "v"), *base]
    assert cli_main(args) == 0
    assert "vllm serve" in capsys.readouterr().out
    with torch.no_grad():
        x = torch.randn(3, 32)
        assert torch.equal(import_medusa(tmp_path / "v")(x), heads.bind(model)(x))
    args = ["export", str(tmp_path / "heads"), "--format", "tensorrt-llm-medusa", "--output", str(tmp_path / "t")]
    assert cli_main([*args, *base, "--tree-size", "9", "--top-k", "3"]) == 0
    assert "trtllm-build" in capsys.readouterr().out
    choices = json.loads((tmp_path / "t" / "medusa_choices.json").read_text())
    assert len(choices) == 8
    assert_tree(choices, num_heads=3, top_k=3)
    accuracy = tmp_path / "acc.json"
    accuracy.write_text(json.dumps([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]))
    assert (
        cli_main([*args[:-1], str(tmp_path / "t2"), *base, "--tree-size", "5", "--rank-accuracy", str(accuracy)]) == 0
    )
    assert json.loads((tmp_path / "t2" / "medusa_choices.json").read_text()) == [[0], [0, 0], [1], [0, 1]]
    previous = random_heads(model, num_heads=2, token_input="previous")
    previous.save_pretrained(tmp_path / "previous")
    args = ["export", str(tmp_path / "previous"), "--format", "vllm-medusa", "--output", str(tmp_path / "p"), *base]
    assert cli_main(args) == 2
    assert "token_input='previous'" in capsys.readouterr().out and not (tmp_path / "p").exists()


@pytest.mark.real
def test_the_shipped_medusa_heads_export_for_vllm_and_decode_identically_after_import(tmp_path, capsys):
    drafter = hf_bpd.load_packaged_drafter(heads="medusa")
    cfg = drafter.heads.config
    assert (cfg.token_input, cfg.copy_dim, cfg.base_model_name) == ("", 0, "HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="kinds: \\['default', 'medusa'\\]"):
        hf_bpd.load_packaged_drafter(heads="eagle")
    out = tmp_path / "vllm"
    args = ["export", "packaged-medusa", "--format", "vllm-medusa", "--base-model", "packaged", "--output", str(out)]
    assert cli_main(args) == 0 and "vllm serve" in capsys.readouterr().out
    model, tokenizer = hf_bpd.load_packaged_model()
    imported = BlockDrafter(import_medusa(out).bind(model), top_k=10, max_tree_tokens=16, context_lookup=0)
    shipped = hf_bpd.load_packaged_drafter(heads="medusa", max_tree_tokens=16, context_lookup=0)
    inputs = hf_bpd.io.models.chat_inputs(tokenizer, [{"role": "user", "content": "Name three colours."}])
    outs = [
        model.generate(**inputs, max_new_tokens=24, custom_generate=hf_bpd.generate, assistant=d)
        for d in (shipped, imported)
    ]
    assert outs[0].tolist() == outs[1].tolist() == model.generate(**inputs, max_new_tokens=24, do_sample=False).tolist()
    assert shipped.stats.accepted_lengths == imported.stats.accepted_lengths  # the same drafts, step for step
