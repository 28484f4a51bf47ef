"""Heads reading several layers (`feature_layers`, issue #59): the option in the config (old configs load
unchanged), the hooks that capture the layers (the same tensors as `output_hidden_states=True`, removed
after), decoding with fusion heads (token-identical to plain greedy, one row and a batch), and training
them (`--feature-layers`, `--own-prediction`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_distilled, tiny_model
from test_training import args_for

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.drafting.heads import BlockDraftHeadsConfig, check_feature_layers, normalise_feature_layers
from hf_bpd.drafting.layer_features import LayerFeatures, decoder_layers, decoding_features, only_last_position
from hf_bpd.io.export import medusa_blockers
from hf_bpd.training import objective, train_heads
from hf_bpd.training.checkpoint import run_fingerprint

DEPTH = 4  # decoder layers of the tiny models here: hidden states 0..4


def model_of(arch: str = "llama", **kw):
    return tiny_model(arch, num_hidden_layers=DEPTH, eos_token_id=None, **kw)


def randomised(heads: BlockDraftHeads, seed: int = 0, std: float = 0.3) -> BlockDraftHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return heads


def hooks(model) -> list[int]:
    """How many hooks the model and each module hold, once transformers has installed its own recorders
    (at the first forward asked for hidden states: they stay)."""
    with torch.no_grad():
        model(torch.tensor([[3]]), output_hidden_states=-1)
    return [
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(getattr(m, "_forward_hooks_with_kwargs", {}))
        for m in model.modules()
    ]


# --- the option ---


def test_feature_layers_are_canonical_and_checked():
    assert check_feature_layers(None) is None
    assert check_feature_layers([-1, 15, 2]) == [2, 15, -1]
    assert normalise_feature_layers([2, -15, -1], 30) == [2, 16, -1]
    assert normalise_feature_layers([0, 30], 30) == [0, -1]  # hidden state 30 of 30 layers: the final one
    for bad in ([2, 15], [-1], [2, 2, -1]):
        with pytest.raises(ValueError, match="feature_layers"):
            check_feature_layers(bad)
    with pytest.raises(ValueError, match="normalise_feature_layers"):
        check_feature_layers([-2, -1])
    with pytest.raises(ValueError, match="outside"):
        normalise_feature_layers([31, -1], 30)


@pytest.mark.parametrize("layers", [None, [1, 3, -1]])
def test_config_round_trip(tmp_path, layers):
    model = model_of()
    heads = randomised(BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=layers))
    heads.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["feature_layers"] == layers
    again = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert again.config.feature_layers == layers and (again.fusion is None) == (layers is None)
    for (name, a), (_, b) in zip(sorted(heads.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name


def test_negative_layers_resolve_against_the_base_model():
    heads = BlockDraftHeads.for_base_model(model_of(), num_heads=2, feature_layers=[-4, -2, -1])
    assert heads.config.feature_layers == [1, 3, -1]


def test_a_config_written_before_the_option_loads_unchanged(tmp_path):
    model = model_of()
    heads = randomised(BlockDraftHeads.for_base_model(model, num_heads=2, token_input="previous"))
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["feature_layers"]  # as every config before the option
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert old.config.feature_layers is None and old.fusion is None
    x, tokens = torch.randn(5, 32), torch.randint(0, 97, (5, 2))
    assert torch.equal(old(x, tokens), heads(x, tokens))
    assert BlockDraftHeadsConfig.from_dict(config).feature_layers is None


def test_the_shipped_heads_config_has_no_feature_layers():
    cfg = BlockDraftHeads.saved_config("hf_bpd/assets/smollm2/heads")
    assert cfg.feature_layers is None


@pytest.mark.parametrize("token_input", ["", "next", "previous"])
def test_the_fusion_starts_as_the_identity_on_the_final_state(token_input):
    model = model_of()
    last = randomised(BlockDraftHeads.for_base_model(model, num_heads=3, token_input=token_input))
    fused = last.with_feature_layers([0, 2, -1])
    assert fused.config.feature_layers == [0, 2, -1] and last.fusion is None
    features = torch.randn(6, 3 * 32) * 5
    tokens = {"": None, "next": torch.randint(0, 97, (6,)), "previous": torch.randint(0, 97, (6, 3))}[token_input]
    assert torch.equal(fused(features, tokens), last(features[:, -32:], tokens))  # bit-identical
    assert torch.equal(fused.fuse(features), features[:, -32:])
    fresh = BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[1, -1])
    assert torch.equal(fresh.fuse(features[:, :64]), features[:, 32:64])
    with pytest.raises(ValueError, match="expected features of width 64"):
        fresh.fuse(features)


def test_heads_reading_a_layer_the_model_lacks_are_refused():
    model = model_of()
    heads = BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[3, -1])
    model.model.layers = model.model.layers[:2]  # the same LM head, 2 layers: hidden states 0..2
    with pytest.raises(ValueError, match="has 2 decoder layers"):
        heads.bind(model)


def test_medusa_export_refuses_fusion_heads():
    heads = BlockDraftHeads.for_base_model(model_of(), num_heads=2, token_input="", feature_layers=[1, -1])
    assert any("feature_layers" in why for why in medusa_blockers(heads))


# --- the hooks ---


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [[0, 2, -1], [1, 3, -1], [0, 1, 2, 3, -1]])
def test_hooks_give_exactly_the_hidden_states_output_hidden_states_gives(arch, layers):
    model = model_of(arch)
    ids = torch.randint(3, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        every = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    before = hooks(model)
    with torch.no_grad(), LayerFeatures(model, layers) as capture:
        assert hooks(model) != before
        out = model(ids, attention_mask=mask, output_hidden_states=-1)  # the final state alone, as decoding asks
        got = capture.features(out)
        capture.last_only = True
        out = model(ids, attention_mask=mask, output_hidden_states=-1)
        last = capture.features(out)
    want = torch.cat([every[i] for i in layers], dim=-1)
    assert torch.equal(got, want)
    assert torch.equal(last, want[:, -1:])
    assert hooks(model) == before and not model._forward_hooks and not model._forward_pre_hooks


def test_hooks_are_removed_when_the_forward_fails():
    model = model_of()
    before = hooks(model)
    with pytest.raises(RuntimeError, match="boom"), LayerFeatures(model, [1, -1]):
        raise RuntimeError("boom")
    assert hooks(model) == before and not model._forward_hooks


def test_decoder_layers_are_found_or_named_missing():
    model = model_of()
    assert decoder_layers(model) is model.model.layers
    with pytest.raises(ValueError, match="no decoder layer list"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_decoding_features_fuse_every_position_and_the_prefill_keeps_the_last():
    model = model_of()
    heads = randomised(BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[1, 3, -1]))
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        every = model(ids, output_hidden_states=True).hidden_states
        want = heads.fuse(torch.cat([every[1], every[3], every[4]], dim=-1))
        with decoding_features(model, heads):
            out = model(ids, output_hidden_states=-1)
            assert len(out.hidden_states) == 1 and torch.allclose(out.hidden_states[-1], want, atol=1e-6)
            with only_last_position(model):
                out = model(ids, output_hidden_states=-1)
            assert torch.allclose(out.hidden_states[-1], want[:, -1:], atol=1e-6)
    assert not model._forward_hooks and not model._forward_pre_hooks


# --- decoding ---


def greedy_pair(model, drafter, **inputs):
    kw = dict(do_sample=False, max_new_tokens=40, pad_token_id=0)
    ref = model.generate(**inputs, **kw)
    out = model.generate(**inputs, **kw, custom_generate=hf_bpd.generate, assistant=drafter)
    return ref, out


@pytest.mark.parametrize("token_input", ["", "next", "previous"])
def test_one_row_with_fusion_heads_equals_plain_greedy(token_input):
    model = model_of()
    heads = randomised(
        BlockDraftHeads.for_base_model(model, num_heads=3, token_input=token_input, feature_layers=[0, 2, -1]), std=0.2
    )
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=16)
    before = hooks(model)
    for seed in range(3):
        ids = torch.randint(3, 97, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        ref, out = greedy_pair(model, drafter, input_ids=ids)
        assert out.tolist() == ref.tolist()
    assert hooks(model) == before and not model._forward_hooks and not model._forward_pre_hooks


def test_a_batch_with_fusion_heads_equals_plain_batched_greedy():
    model = model_of()
    heads = randomised(BlockDraftHeads.for_base_model(model, num_heads=3, feature_layers=[1, 3, -1]), std=0.2)
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 9, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref, out = greedy_pair(model, drafter, input_ids=ids, attention_mask=mask)
    assert out.tolist() == ref.tolist()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_sampling_with_fusion_heads_gives_plain_samplings_tokens_for_a_seed():
    model = model_of()
    heads = BlockDraftHeads.for_base_model(model, num_heads=3, feature_layers=[2, -1])  # identity fusion: accepts
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=12)
    ids = torch.tensor([[5, 6, 7, 8]])
    for seed in range(3):
        torch.manual_seed(seed)
        ref = model.generate(ids, do_sample=True, max_new_tokens=30, top_k=20)
        torch.manual_seed(seed)
        out = model.generate(
            ids, do_sample=True, max_new_tokens=30, top_k=20, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert out.tolist() == ref.tolist(), seed


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_model_with_recurrent_state_decodes_fusion_heads_exactly(batch_size):
    from test_hybrid import build

    model = build("LFM2")  # chains verified by `verify_chain` (`recurrent.py`)
    heads = BlockDraftHeads.for_base_model(model, num_heads=3, feature_layers=[1, -1])
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    ids = torch.randint(3, 50, (batch_size, 6), generator=torch.Generator().manual_seed(batch_size))
    kw = dict(do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, **kw, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist() and max(drafter.stats.accepted_lengths) > 1
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_identity_fusion_heads_draft_exactly_as_the_last_layer_heads_they_came_from(monkeypatch):
    """The fused state reaches the drafter at the accepted node's position: fusion heads at their identity
    start accept exactly the lengths their last-layer heads accept, every step."""
    model = model_of()
    last = randomised(BlockDraftHeads.for_base_model(model, num_heads=3, token_input="next"), std=0.05)
    fused = last.with_feature_layers([1, -1])
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    runs = []
    for heads in (last, fused):
        drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=16)
        _, out = greedy_pair(model, drafter, input_ids=ids)
        runs.append((out.tolist(), drafter.stats.accepted_lengths))
    assert runs[0] == runs[1] and max(runs[0][1]) > 1
    # and the fusion read what the forwards gave: the prefill's last position, then every tree node
    widths = []
    real = BlockDraftHeads.fuse
    monkeypatch.setattr(BlockDraftHeads, "fuse", lambda self, f: widths.append(tuple(f.shape)) or real(self, f))
    greedy_pair(model, BlockDrafter(fused, top_k=3, max_tree_tokens=16), input_ids=ids)
    assert widths[0] == (1, 1, 64) and all(w[0] == 1 and w[2] == 64 for w in widths) and widths[1][1] > 1


def test_a_static_cache_or_compiled_forward_is_refused_for_fusion_heads():
    model = model_of()
    heads = BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[1, -1])
    ids = torch.randint(3, 97, (1, 5))
    with pytest.raises(ValueError, match="not yet served with a compiled forward or a static cache"):
        model.generate(
            ids,
            max_new_tokens=4,
            cache_implementation="static",
            custom_generate=hf_bpd.generate,
            assistant=BlockDrafter(heads),
        )


# --- training ---


def test_compute_features_of_feature_layers_are_the_hidden_states_of_those_layers():
    model = model_of()
    data = tiny_distilled(model, n=3, new=6)
    feats = train_heads.compute_features(model, data, 2, progress=False, feature_layers=[1, -1])
    plain = train_heads.compute_features(model, data, 2, progress=False)
    assert feats.hidden.shape[1] == 64 and torch.equal(feats.hidden[:, 32:], plain.hidden)
    assert torch.equal(feats.targets, plain.targets) and torch.equal(feats.sample, plain.sample)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_last_layer_cache_reads_the_final_state_from_a_layers_cache_instead_of_computing_it(tmp_path, monkeypatch):
    model = model_of()
    data = tiny_distilled(model, n=7, new=6)
    plain = train_heads.compute_features(model, data, 2, progress=False)
    cache = tmp_path / "features"
    train_heads.cached_features(model, data.select(range(4)), 2, cache, chunk=4, progress=False, feature_layers=[1, -1])
    computed = []
    real = train_heads.compute_features

    def counting(model, rows, *a, **kw):
        computed.append((len(rows), kw.get("feature_layers")))
        return real(model, rows, *a, **kw)

    monkeypatch.setattr(train_heads, "compute_features", counting)
    got = train_heads.cached_features(model, data, 2, cache, chunk=4, progress=False)
    assert computed == [(3, None)]  # samples 0..3 from the layers' cache: only 4..6 computed
    for f in ("hidden", "targets", "next_token", "sample"):
        assert torch.equal(getattr(got, f), getattr(plain, f)), f
    assert sorted(p.name for p in (cache / "layers-1-final").iterdir()) == ["features-0000000-0000004.pt"]


def test_training_fusion_heads_changes_the_fusion_and_decodes_losslessly(tmp_path):
    model = model_of()
    data = tiny_distilled(model, n=12, new=12)
    args = args_for(
        tmp_path,
        num_heads=2,
        epochs=2,
        lr=1e-2,
        batch_size=32,
        val_fraction=0.2,
        top_k=3,
        feature_layers="2,-1",
        teacher_weight=0.5,
    )
    heads, history = train_heads.train_frozen(model, data, args)
    assert heads.config.feature_layers == [2, -1]
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in history)
    start = BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[2, -1])
    assert not torch.equal(heads.fusion.linear.weight, start.fusion.linear.weight.float())
    assert (tmp_path / "features" / "layers-2-final").is_dir()  # beside, never instead of, a last-layer cache
    heads.save_pretrained(tmp_path / "heads")
    again = BlockDraftHeads.from_pretrained(tmp_path / "heads").bind(model)
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref, out = greedy_pair(model, BlockDrafter(again, top_k=3, max_tree_tokens=8), input_ids=ids)
    assert out.tolist() == ref.tolist()


def test_init_last_layer_heads_gain_a_fusion_and_fusion_heads_keep_theirs(tmp_path):
    model = model_of()
    data = tiny_distilled(model, n=8, new=8)
    settings = dict(epochs=1, lr=1e-2, batch_size=32, val_fraction=0.25, top_k=3)
    first, _ = train_heads.train_frozen(model, data, args_for(tmp_path / "a", num_heads=2, **settings))
    first.save_pretrained(tmp_path / "last")
    fused, log = train_heads.train_frozen(
        model, data, args_for(tmp_path / "b", init=tmp_path / "last", feature_layers="1,-1", **settings)
    )
    assert fused.config.feature_layers == [1, -1]
    fused.save_pretrained(tmp_path / "fused")
    again, _ = train_heads.train_frozen(model, data, args_for(tmp_path / "c", init=tmp_path / "fused", **settings))
    assert again.config.feature_layers == [1, -1]
    with pytest.raises(ValueError, match="--feature-layers \\[3, -1\\] differs"):
        train_heads.train_frozen(
            model, data, args_for(tmp_path / "d", init=tmp_path / "fused", feature_layers="3,-1", **settings)
        )


def test_own_prediction_tokens_follow_the_heads_greedy_branch():
    model = model_of()
    heads = randomised(BlockDraftHeads.for_base_model(model, num_heads=3, feature_layers=[1, -1]), std=0.2).float()
    features = torch.randn(7, 64)
    true = torch.randint(0, 97, (7, 3))
    assert torch.equal(objective.own_prediction_tokens(heads, features, true, 0.0), true)
    own = objective.own_prediction_tokens(heads, features, true, 1.0)
    state = heads.fuse(features)
    assert torch.equal(own[:, 0], true[:, 0])  # head 1 reads token t+1, the base model's own choice
    for i in range(2):  # head i+2 reads what head i+1 predicts from what it read itself
        want = heads.project(heads.step(i, state, own[:, i])).argmax(-1)
        assert torch.equal(own[:, i + 1], heads.draft_vocab[want])
    torch.manual_seed(0)
    sampled = objective.own_prediction_tokens(heads, features, true, 1.0, top_k=3)
    assert sampled.shape == true.shape and torch.equal(sampled[:, 0], true[:, 0])


def test_own_prediction_training_runs_and_needs_previous_heads(tmp_path):
    model = model_of()
    data = tiny_distilled(model, n=8, new=8)
    settings = dict(num_heads=3, epochs=1, lr=1e-2, batch_size=32, val_fraction=0.25, top_k=3)
    heads, history = train_heads.train_frozen(
        model, data, args_for(tmp_path / "a", own_prediction=0.5, own_top_k=2, **settings)
    )
    assert torch.isfinite(torch.tensor(history[-1]["train_loss"]))
    with pytest.raises(ValueError, match="--token-input previous"):
        train_heads.train_frozen(
            model, data, args_for(tmp_path / "b", own_prediction=1.0, token_input="next", **settings)
        )


def test_runs_checkpointed_before_the_new_options_keep_their_fingerprint(tmp_path):
    args = args_for(tmp_path)
    fingerprint = run_fingerprint(args, "digest")
    assert not {"feature_layers", "own_prediction", "own_top_k"} & set(fingerprint)
    assert run_fingerprint(args_for(tmp_path, feature_layers="1,-1"), "digest")["feature_layers"] == [1, -1]
