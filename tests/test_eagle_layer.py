"""The EAGLE draft layer (`drafting/eagle.py`): its block is a Llama decoder layer, its incremental context and
tree drafting compute exactly what the training-time unroll computes along each node's path, it saves and
loads, decoding with it gives plain greedy's and seeded sampling's tokens, replay matches the loop, and what it
cannot serve is refused before any forward."""

from __future__ import annotations

import pytest
import torch

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.drafting.eagle import EagleContext, EagleDraftLayer, grow_tree
from hf_bpd.drafting.files import drafting_module
from hf_bpd.tools.replay import replay_turn
from hf_bpd.training.train_eagle import eagle_loss, padded_batch
from tests.conftest import assert_replay_matches_loop, random_heads, tiny_model


def random_layer(model, seed: int = 0, std: float = 0.3) -> EagleDraftLayer:
    """A layer with random weights (its drafts depend on the token and the context), norms kept at 1."""
    layer = EagleDraftLayer.for_base_model(model, start_as_identity=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return layer.eval()


def sequence(length: int, model, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.config.vocab_size, (length,), generator=g)
    return tokens, torch.randn(length, model.config.hidden_size, generator=g)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])  # Gemma-3's query, key and output norms kept
def test_depth_one_is_the_base_model_s_last_decoder_layer_then_the_final_norm(arch):
    model = tiny_model(arch)
    layer = EagleDraftLayer.for_base_model(model, start_as_identity=False)
    assert (layer.config.qk_norm, layer.config.sandwich_norms) == (arch != "llama", arch == "gemma3")
    tokens, features = sequence(9, model, 0)
    with torch.no_grad():
        ours = layer.unroll(features[None], tokens[None], 1)[0]
        _, embedding = layer._bound()
        x = layer.fc(torch.cat([layer.token_norm(embedding[tokens[1:]]), layer.feature_norm(features[:-1])], -1))[None]
        positions = torch.arange(8)[None]
        mask = torch.full((8, 8), float("-inf")).triu(1)[None, None]
        block = model.model.layers[-1]
        rotary = (model.model.rotary_emb, *(("full_attention",) if arch == "gemma3" else ()))
        embeddings = rotary[0](x, positions, *rotary[1:])
        out = block(x, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
        theirs = model.model.norm(out[0] if isinstance(out, tuple) else out)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_a_new_layer_s_first_prediction_is_the_normed_feature_itself(arch):
    """The identity start: fc passes the feature through and the block adds nothing (Gemma's output norms
    scale its attention and MLP to zero, a Llama's output projections are zero)."""
    model = tiny_model(arch)
    layer = EagleDraftLayer.for_base_model(model)
    tokens, features = sequence(9, model, 0)
    with torch.no_grad():
        ours = layer.unroll(features[None], tokens[None], 1)[0]
    torch.testing.assert_close(ours[0], layer.out_norm(layer.feature_norm(features[:-1])), rtol=1e-5, atol=1e-5)


def test_a_row_reads_no_later_position_and_padding_changes_nothing():
    model = tiny_model()
    layer = random_layer(model)
    depth = 3
    long, short = (*sequence(12, model, 1), 2), (*sequence(7, model, 2), 2)
    long, short = (long[0], long[1].half(), 2), (short[0], short[1].half(), 2)
    with torch.no_grad():
        together = layer.unroll(*padded_batch([long, short])[:2], depth)
        alone = layer.unroll(*padded_batch([short])[:2], depth)
        for j in range(depth):
            torch.testing.assert_close(together[j][1, :6], alone[j][0], rtol=1e-5, atol=1e-5)
        t = 4  # row t at depth j reads features <= t and tokens <= t + j: change everything after them
        tokens, features, start = long
        tokens2, features2 = tokens.clone(), features.clone()
        features2[t + 1 :] += 1.0
        tokens2[t + depth + 1 :] = (tokens2[t + depth + 1 :] + 1) % model.config.vocab_size
        moved = layer.unroll(*padded_batch([(tokens2, features2, start)])[:2], depth)
        before = layer.unroll(*padded_batch([long])[:2], depth)
    for j in range(depth):
        torch.testing.assert_close(moved[j][0, : t + 1], before[j][0, : t + 1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(moved[j][0, t + 1 :], before[j][0, t + 1 :])


def test_the_context_extended_in_pieces_is_the_unrolled_first_depth():
    model = tiny_model()
    layer = random_layer(model)
    tokens, features = sequence(12, model, 1)
    context = EagleContext()
    context.extend(layer, features[:5], tokens[1:6])
    context.extend(layer, features[5:11], tokens[6:12])
    with torch.no_grad():
        unrolled = layer.unroll(features[None], tokens[None], 1)[0]
    assert context.rows == 11
    torch.testing.assert_close(context.prediction, unrolled[0, 10:11], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_tree_node_drafts_what_the_unroll_drafts_along_its_path(seed):
    """Tree attention: a node's children are the top-k of the prediction the training-time unroll makes on the
    node's own path (context rows, its ancestors, itself), with the same log-probabilities."""
    model = tiny_model()
    layer = random_layer(model, seed)
    n = 10
    tokens, features = sequence(n + 1, model, seed + 5)  # context tokens 0..n, the root is token n
    context = EagleContext()
    context.extend(layer, features[:n], tokens[1 : n + 1])
    tree, arcs = grow_tree(layer, context, int(tokens[n]), top_k=3, budget=24)
    assert len(tree) == 24 and max(tree.depths) >= 3  # a real tree, several levels deep
    paths = tree.node_paths()
    for node in range(len(tree)):
        children = [c for c in range(1, len(tree)) if tree.parents[c] == node]
        if not children:
            continue
        depth = tree.depths[node] + 1
        path_tokens = torch.cat([tokens, torch.tensor(paths[node], dtype=torch.long)])
        with torch.no_grad():  # row n-1 at depth d reads the token at n-1+d: the root, then the path's
            predicted = layer.unroll(features[None, : n + 1], path_tokens[None], depth)[depth - 1][0, n - 1]
            ids, logprobs = layer.top_tokens(predicted[None], 3)
        for child in children:
            assert tree.tokens[child] in ids[0].tolist()
            expected = logprobs[0, ids[0].tolist().index(tree.tokens[child])]
            assert arcs[child].logprob == pytest.approx(float(expected), abs=1e-4)


def test_saved_layer_loads_with_its_outputs_and_as_a_drafter(tmp_path):
    model = tiny_model()
    layer = random_layer(model)
    layer.save_pretrained(tmp_path / "layer")
    loaded = EagleDraftLayer.from_pretrained(tmp_path / "layer").bind(model)
    tokens, features = sequence(8, model, 2)
    with torch.no_grad():
        for a, b in zip(layer.unroll(features[None], tokens[None], 3), loaded.unroll(features[None], tokens[None], 3)):
            torch.testing.assert_close(a, b)
    BlockDrafter(layer, top_k=4, max_tree_tokens=8).save_pretrained(tmp_path / "drafter")
    drafter = BlockDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.reads_context and (drafter.top_k, drafter.max_tree_tokens) == (4, 8)
    heads = random_heads(model)
    heads.save_pretrained(tmp_path / "heads")
    assert not isinstance(drafting_module(tmp_path / "heads"), EagleDraftLayer)
    with pytest.raises(ValueError, match="not a draft-layer checkpoint"):
        EagleDraftLayer.from_pretrained(tmp_path / "heads")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_training_loss_falls_and_reaches_every_trained_weight(arch):
    model = tiny_model(arch)
    layer = EagleDraftLayer.for_base_model(model).train()
    layer.requires_grad_(True)
    items = [(*sequence(10 + i, model, i), 3) for i in range(4)]
    items = [(t, f.half(), s) for t, f, s in items]
    start = {name: p.detach().clone() for name, p in layer.named_parameters()}
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = eagle_loss(layer, items, depth=3, cls_weight=1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    # the tiny Gemma's tied LM head is not sharpened (conftest): its cross-entropy part barely moves
    assert losses[-1] < (0.85 if arch == "llama" else 0.9) * losses[0]
    # the block starts as the identity (zero output projections or output norms): its inner weights learn once
    # those move
    assert [name for name, p in layer.named_parameters() if torch.equal(p, start[name])] == []
    features, tokens, lengths = padded_batch(items)
    assert features.shape == (4, 13, model.config.hidden_size) and lengths.tolist() == [10, 11, 12, 13]


@pytest.mark.parametrize("resume_after", [2, 3, 4])  # within the first epoch, at its end, within the second
def test_training_resumed_takes_the_same_steps(resume_after):
    import argparse
    import copy

    from hf_bpd.training.train_eagle import train

    model = tiny_model()
    items = [(t, f.half(), 3) for t, f in (sequence(8 + i, model, i) for i in range(6))]
    # 3 batches an epoch: saved after steps 2, 3 (an epoch's end), 4 and 6
    args = argparse.Namespace(lr=1e-2, seed=0, batch_samples=2, epochs=2, depth=2, cls_weight=1.0, save_every=2)
    saved, saved_at = {}, []

    def keep(losses, optimizer, schedule):
        saved_at.append(len(losses))
        if len(losses) == resume_after:
            saved.update(
                weights=copy.deepcopy(straight.state_dict()),
                state={"losses": list(losses), "optimizer": copy.deepcopy(optimizer.state_dict())}
                | {"schedule": schedule.state_dict()},
            )

    straight = EagleDraftLayer.for_base_model(model).requires_grad_(True)
    losses = train(straight, items, args, keep)
    assert saved_at == [2, 3, 4, 6] and len(losses) == 6
    resumed = EagleDraftLayer.for_base_model(model).requires_grad_(True)
    resumed.load_state_dict(saved["weights"])
    assert train(resumed, items, args, resume=saved["state"]) == losses
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_train_eagle_refuses_to_overwrite_a_run_or_resume_it_with_other_settings(tmp_path):
    from hf_bpd.training import train_eagle

    argv = ["--data", "d", "--samples", "4", "--heads", "h", "--features-cache", "c", "--output", str(tmp_path)]
    torch.save({"settings": {}}, tmp_path / train_eagle.CHECKPOINT)
    with pytest.raises(SystemExit, match="pass --resume"):
        train_eagle.main(argv)
    with pytest.raises(SystemExit, match="other settings"):
        train_eagle.main([*argv, "--resume"])
    with pytest.raises(SystemExit, match="--depth must be at least 1"):
        train_eagle.main([*argv, "--depth", "0"])
    # a run saved before an option existed resumes where the option keeps its default (None)
    assert train_eagle.changed_settings({"depth": 3}, {"depth": 3, "init": None}) == []
    assert train_eagle.changed_settings({"depth": 3}, {"depth": 2, "init": "x"}) == ["depth", "init"]


def test_train_eagle_refuses_an_init_that_is_no_layer_or_drafts_to_another_depth(tmp_path):
    from hf_bpd.training import train_eagle

    model = tiny_model()
    EagleDraftLayer.for_base_model(model, max_depth=4).save_pretrained(tmp_path / "layer")
    random_heads(model).save_pretrained(tmp_path / "heads")
    argv = ["--data", "d", "--samples", "4", "--heads", "h", "--features-cache", "c", "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="--init: .* not a draft-layer checkpoint"):
        train_eagle.main([*argv, "--init", str(tmp_path / "heads")])
    with pytest.raises(SystemExit, match="drafts 4 deep, not --max-depth 5"):
        train_eagle.main([*argv, "--init", str(tmp_path / "layer")])


def test_train_eagle_starts_from_an_init_layer(tmp_path, monkeypatch):
    from hf_bpd.io import models
    from hf_bpd.training import train_eagle

    model = tiny_model()
    heads = random_heads(model)
    heads.save_pretrained(tmp_path / "heads")
    start = random_layer(model, seed=5)
    start.save_pretrained(tmp_path / "layer")
    monkeypatch.setattr(models, "load_model", lambda name, device: (model, None))
    monkeypatch.setattr(train_eagle, "training_items", lambda model, args: [])
    trained = {}
    monkeypatch.setattr(train_eagle, "train", lambda layer, *a: trained.update(layer.state_dict()))
    argv = ["--data", "d", "--samples", "4", "--heads", str(tmp_path / "heads"), "--features-cache", "c"]
    argv += ["--output", str(tmp_path / "o"), "--init", str(tmp_path / "layer")]
    assert train_eagle.main(argv) == 0
    for name, value in start.state_dict().items():
        assert torch.equal(trained[name], value), name
    other = tiny_model(seed=1)  # another base model: its layer is refused
    EagleDraftLayer.for_base_model(other).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="another base model"):
        train_eagle.main([*argv[:-1], str(tmp_path / "other")])


@pytest.mark.parametrize("init_base_norms", [None, False, True])  # no --init, a Llama-style block, Gemma's own
def test_train_eagle_keeps_the_block_kind_of_the_layer_it_continues(tmp_path, monkeypatch, init_base_norms):
    """A new Gemma-3 layer keeps its base layer's query, key and output norms; `--init` from a layer saved
    before them continues it as the Llama-style block it is, and `--resume` continues the run's own kind."""
    from hf_bpd.io import models
    from hf_bpd.training import train_eagle

    model = tiny_model("gemma3")
    random_heads(model).save_pretrained(tmp_path / "heads")
    monkeypatch.setattr(models, "load_model", lambda name, device: (model, None))
    monkeypatch.setattr(train_eagle, "training_items", lambda model, args: [(torch.zeros(3), None, 0)])
    kinds = []

    def one_saved_step(layer, items, args, save, state):  # the run's first step, saved as a run saves it
        kinds.append((layer.config.qk_norm, layer.config.sandwich_norms))
        optimizer = torch.optim.AdamW(layer.parameters())
        save([1.0], optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))

    monkeypatch.setattr(train_eagle, "train", one_saved_step)
    argv = ["--data", "d", "--samples", "4", "--heads", str(tmp_path / "heads"), "--features-cache", "c"]
    argv += ["--output", str(tmp_path / "o")]
    if init_base_norms is not None:
        start = EagleDraftLayer.for_base_model(model, base_norms=init_base_norms)
        assert (start.q_norm is None, start.mlp_out_norm is None) == (not init_base_norms,) * 2
        start.save_pretrained(tmp_path / "layer")
        argv += ["--init", str(tmp_path / "layer")]
    assert train_eagle.main(argv) == 0
    assert train_eagle.main([*argv, "--resume"]) == 0  # loads the saved weights into a block of their kind
    expected = (init_base_norms is not False,) * 2
    assert kinds == [expected, expected]


def test_a_layer_saved_before_the_base_layer_s_norms_loads_as_the_llama_style_block_it_was():
    saved = EagleDraftLayer.from_pretrained("training/candidates/gemma3_270m_eagle_d3_4k_e1")
    assert (saved.config.qk_norm, saved.config.sandwich_norms, saved.config.attention_scale) == (False, False, 0.0)
    assert saved.q_norm is None and saved.attention_out_norm is None and saved.mlp_out_norm is None


def greedy(model, ids, n, **kw):
    return model.generate(ids, do_sample=False, max_new_tokens=n, **kw)


@pytest.mark.parametrize("cache,arch", [("dynamic", "llama"), ("static", "llama"), ("dynamic", "gemma3")])
def test_decoding_with_the_layer_gives_greedy_s_tokens(cache, arch):
    model = tiny_model(arch, eos_token_id=None)
    layer = random_layer(model, std=0.1)
    g = torch.Generator().manual_seed(3)
    extra = {} if cache == "dynamic" else {"cache_implementation": "static"}
    drafted = 0
    for trial in range(4):
        ids = torch.randint(3, 97, (1, int(torch.randint(2, 10, (1,), generator=g))), generator=g)
        drafter = BlockDrafter(layer, top_k=3, max_tree_tokens=10)
        ours = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter, **extra)
        assert torch.equal(ours, greedy(model, ids, 30, **extra)), trial
        assert set(drafter.stats.tree_sizes) != {1}
        drafted += sum(n - 1 for n in drafter.stats.accepted_lengths)
    assert drafted > 0  # some drafts were accepted, not only bonus tokens


def test_compact_weights_round_the_layer_in_place_and_still_give_greedy_s_tokens(tmp_path):
    from hf_bpd.cpu.streamed_linear import round_q8_0

    model = tiny_model(eos_token_id=None)
    layer = random_layer(model, std=0.1)
    before = {name: p.clone() for name, p in layer.named_parameters()}
    drafter = BlockDrafter(layer, top_k=3, max_tree_tokens=10, compact_weights=True)
    for name, p in layer.named_parameters():  # every linear weight rounded, norms and biases as they were
        expected = round_q8_0(before[name]) if name.endswith("proj.weight") or name == "fc.weight" else before[name]
        assert torch.equal(p, expected), name
    assert not torch.equal(layer.fc.weight, before["fc.weight"])
    ids = torch.tensor([[5, 9, 17, 3]])
    ours = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter)
    assert torch.equal(ours, greedy(model, ids, 30))
    drafter.save_pretrained(tmp_path)
    assert BlockDrafter.from_pretrained(tmp_path).compact_weights is True
    with pytest.raises(ValueError, match="compact_weights must be True or False"):
        BlockDrafter(layer, compact_weights="q8_0")


def test_seeded_sampling_with_the_layer_gives_plain_sampling_s_tokens():
    model = tiny_model(eos_token_id=None)
    layer = random_layer(model, std=0.1)
    ids = torch.tensor([[5, 9, 11, 4]])
    kw = dict(do_sample=True, temperature=0.7, top_k=20, max_new_tokens=25)
    torch.manual_seed(7)
    plain = model.generate(ids, **kw)
    torch.manual_seed(7)
    ours = model.generate(ids, custom_generate=hf_bpd.generate, assistant=BlockDrafter(layer, top_k=3), **kw)
    assert torch.equal(plain, ours)


@pytest.mark.parametrize("context_vocab", [False, True])
def test_replay_matches_the_decoding_loop_with_the_layer(context_vocab):
    model = tiny_model(eos_token_id=None)
    layer = random_layer(model, std=0.1)
    if context_vocab:  # a draft vocabulary the context's tokens reach beyond
        narrow = EagleDraftLayer.for_base_model(model, draft_vocab=torch.arange(0, 97, 3), start_as_identity=False)
        narrow.load_state_dict(layer.state_dict(), strict=False)
        layer = narrow.eval()
    g = torch.Generator().manual_seed(4)
    for trial in range(3):
        ids = torch.randint(3, 97, (1, int(torch.randint(2, 12, (1,), generator=g))), generator=g)
        assert_replay_matches_loop(
            model,
            lambda: BlockDrafter(layer, top_k=3, max_tree_tokens=12, context_vocab=context_vocab),
            ids,
            trial=trial,
        )


def test_the_prompt_s_rows_run_with_the_prefill_and_each_step_s_at_the_next_draft():
    # the prompt's rows at start_context, so that the first drafted step is not charged for them (the step
    # chooser judges drafting by its steps' times); a step's accepted rows wait for the next draft
    model = tiny_model()
    drafter = BlockDrafter(random_layer(model).bind(model), top_k=3, max_tree_tokens=6)
    features = torch.randn(7, model.config.hidden_size)
    drafter.start_context(features[:5], [11, 12, 13, 14, 15])
    assert drafter._context.rows == 5 and drafter._pending == []
    drafter.extend_context(features[5:], [16, 17])
    assert drafter._context.rows == 5 and len(drafter._pending) == 1
    reference = EagleContext()
    reference.extend(drafter.heads, features, torch.tensor([11, 12, 13, 14, 15, 16, 17]))
    assert drafter._context_prediction(8) is drafter._context and drafter._context.rows == 7
    torch.testing.assert_close(drafter._context.prediction, reference.prediction)


def test_what_the_layer_cannot_serve_is_refused_up_front():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = tiny_model()
    layer = random_layer(model)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=4)).eval()
    with pytest.raises(ValueError, match="Llama-style"):
        EagleDraftLayer.for_base_model(gpt2)
    with pytest.raises(ValueError, match="another base model"):
        layer.bind(tiny_model(seed=1))
    with pytest.raises(ValueError, match="EAGLE draft layer has none"):
        BlockDrafter(layer, rescorer=lambda lattice, context: [])
    batch = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match="one row"):
        greedy(model, batch, 5, custom_generate=hf_bpd.generate, assistant=BlockDrafter(layer))
    drafter = BlockDrafter(layer, calibrate=False)
    with pytest.raises(RuntimeError, match="context rows"):  # drafting without the context's features
        drafter.draft(torch.zeros(1, 32), torch.tensor([[5, 6, 7]]))


def fused_copy(layer: EagleDraftLayer, model, feature_layers) -> EagleDraftLayer:
    """`layer` with a new fusion of `feature_layers` (at its identity start), as `train-eagle --init` makes."""
    fused = EagleDraftLayer.for_base_model(model, max_depth=layer.config.max_depth, feature_layers=feature_layers)
    missing, unexpected = fused.load_state_dict(layer.state_dict(), strict=False)
    assert unexpected == [] and all(k.startswith("fusion.") for k in missing)
    return fused.eval()


def test_a_fusion_layer_at_its_start_drafts_as_the_layer_it_extends_and_the_prefill_gives_every_position():
    from hf_bpd.drafting.layer_features import LayerFeatures

    model = tiny_model(eos_token_id=None)
    layer = random_layer(model, std=0.1)
    fused = fused_copy(layer, model, [1, -1])
    assert fused.config.feature_layers == [1, -1] and fused.fusion.in_features == 64
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), LayerFeatures(model, [1, -1]) as capture:
        wide = capture.features(model(ids, output_hidden_states=True))[0]
    tokens, final = ids[0], wide[:, 32:]
    with torch.no_grad():
        for a, b in zip(layer.unroll(final[None], tokens[None], 3), fused.unroll(wide[None], tokens[None], 3)):
            torch.testing.assert_close(a, b)
    runs = []
    for module in (layer, fused):
        drafter = BlockDrafter(module, top_k=3, max_tree_tokens=10)
        out = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter)
        runs.append((out.tolist(), drafter.stats.accepted_lengths, drafter.stats.tree_sizes))
    assert runs[0] == runs[1] and max(runs[0][1]) > 1
    assert torch.equal(torch.tensor(runs[0][0]), greedy(model, ids, 30))
    with pytest.raises(ValueError, match="expected features of width 64, got 32"):
        fused.fuse(final)


def test_a_trained_fusion_layer_decodes_greedy_s_tokens_and_replays_as_the_loop_decodes():
    model = tiny_model(eos_token_id=None)
    fused = fused_copy(random_layer(model, std=0.1), model, [0, 1, -1])
    with torch.no_grad():  # a fusion that reads every layer, as a trained one does
        fused.fusion.linear.weight.add_(0.2 * torch.randn(fused.fusion.linear.weight.shape))
    g = torch.Generator().manual_seed(5)
    for trial in range(3):
        ids = torch.randint(3, 97, (1, int(torch.randint(2, 10, (1,), generator=g))), generator=g)
        drafter = BlockDrafter(fused, top_k=3, max_tree_tokens=10)
        out = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter)
        assert torch.equal(out, greedy(model, ids, 30)), trial
        replayed = replay_turn(
            model, BlockDrafter(fused, top_k=3, max_tree_tokens=10), ids, out[0, ids.shape[1] :].tolist()
        )
        assert replayed.accepted_lengths == drafter.stats.accepted_lengths, trial
    with pytest.raises(ValueError, match="a drafter reading feature layers"):
        greedy(
            model, ids, 5, custom_generate=hf_bpd.generate, assistant=BlockDrafter(fused), cache_implementation="static"
        )


def test_training_a_fusion_layer_reads_the_layers_and_targets_the_final_state():
    from hf_bpd.training.train_eagle import sequence_features

    model = tiny_model()
    seqs = [[5, 9, 11, 4, 7], [3, 8, 20]]
    wide = sequence_features(model, seqs, feature_layers=[1, -1])
    final = sequence_features(model, seqs)
    with torch.no_grad():
        states = model(torch.tensor([seqs[0]]), output_hidden_states=True).hidden_states
    assert wide[0].shape == (5, 64) and wide[1].shape == (3, 64)
    torch.testing.assert_close(wide[0].float(), torch.cat([states[1][0], states[-1][0]], -1).half().float())
    for w, f in zip(wide, final):
        torch.testing.assert_close(w[:, 32:], f)
    layer = random_layer(model, std=0.1)
    fused = fused_copy(layer, model, [1, -1])
    plain_items = [(torch.tensor(s), f, 1) for s, f in zip(seqs, final)]
    wide_items = [(torch.tensor(s), f, 1) for s, f in zip(seqs, wide)]
    with torch.no_grad():  # at its identity start, the fusion layer's loss is the layer's
        torch.testing.assert_close(eagle_loss(fused, wide_items, 2, 1.0), eagle_loss(layer, plain_items, 2, 1.0))


def test_features_beyond_float16_s_range_are_cached_in_bfloat16_and_stale_inf_chunks_computed_again(tmp_path):
    # Gemma-3's middle layers exceed float16's 65,504: a float16 cache held inf, and every loss was nan
    from hf_bpd.training.train_eagle import cached_sequences, sequence_features

    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e6)  # a residual stream beyond float16, as Gemma-3's
    seqs = [[5, 9, 11, 4, 7], [3, 8, 20]]
    wide = sequence_features(model, seqs, feature_layers=[1, -1])
    final = sequence_features(model, seqs)
    assert [f.dtype for f in final] == [torch.float16] * 2  # the final state is normed: float16 holds it
    for seq, got in zip(seqs, wide):
        with torch.no_grad():
            states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        want = torch.cat([states[1][0], states[-1][0]], -1)
        dtype = torch.bfloat16 if want.abs().max() > torch.finfo(torch.float16).max else torch.float16
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.to(dtype).float())
    assert wide[0].dtype == torch.bfloat16
    # what a float16 cache held before: inf, computed again on load rather than trained on
    folder = tmp_path / "layers-1-final"
    folder.mkdir()
    torch.save([w.half() for w in wide], folder / "train-000000-000002.pt")
    assert not torch.isfinite(torch.load(folder / "train-000000-000002.pt")[0]).all()
    items = cached_sequences(model, "train", seqs, [1, 1], tmp_path, feature_layers=[1, -1])
    for (_, got, _), want in zip(items, wide):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(folder / "train-000000-000002.pt"), wide))


def test_training_stops_at_a_non_finite_loss_before_it_changes_a_weight():
    import argparse

    from hf_bpd.training.train_eagle import train

    model = tiny_model()
    items = [(t, f.half(), 3) for t, f in (sequence(8 + i, model, i) for i in range(4))]
    items[3][1][2, 0] = float("inf")
    args = argparse.Namespace(lr=1e-2, seed=0, batch_samples=4, epochs=1, depth=2, cls_weight=1.0, save_every=0)
    layer = EagleDraftLayer.for_base_model(model).requires_grad_(True)
    start = {name: p.detach().clone() for name, p in layer.named_parameters()}
    with pytest.raises(FloatingPointError, match="step 1: the loss is nan; training stopped before this step"):
        train(layer, items, args)
    assert all(torch.equal(p, start[name]) for name, p in layer.named_parameters())


def test_train_eagle_gives_an_init_layer_a_fusion_and_refuses_other_feature_layers(tmp_path, monkeypatch):
    from hf_bpd.io import models
    from hf_bpd.training import train_eagle

    model = tiny_model()
    random_heads(model).save_pretrained(tmp_path / "heads")
    start = random_layer(model, seed=5)
    start.save_pretrained(tmp_path / "layer")
    monkeypatch.setattr(models, "load_model", lambda name, device: (model, None))
    monkeypatch.setattr(train_eagle, "training_items", lambda model, args: [])
    trained = {}
    monkeypatch.setattr(train_eagle, "train", lambda layer, *a: trained.update(layer=layer))
    argv = ["--data", "d", "--samples", "4", "--heads", str(tmp_path / "heads"), "--features-cache", "c"]
    argv += ["--init", str(tmp_path / "layer"), "--feature-layers", "1,-1"]
    assert train_eagle.main([*argv, "--output", str(tmp_path / "o")]) == 0
    layer = trained["layer"]
    assert layer.config.feature_layers == [1, -1]
    for name, value in start.state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), name
    assert (
        torch.equal(layer.fusion.linear.weight[:, 32:], torch.eye(32)) and not layer.fusion.linear.weight[:, :32].any()
    )
    layer.save_pretrained(tmp_path / "fused")
    argv[argv.index(str(tmp_path / "layer"))] = str(tmp_path / "fused")
    with pytest.raises(SystemExit, match=r"reads feature layers \[1, -1\]: pass the same --feature-layers \(1,-1\)"):
        train_eagle.main([*argv[:-1], "0,-1", "--output", str(tmp_path / "o2")])
    with pytest.raises(SystemExit, match="the final one"):
        train_eagle.main([*argv[:-1], "1", "--output", str(tmp_path / "o3")])
    with pytest.raises(ValueError, match="canonical order"):  # the final state must be the last slice
        train_eagle.sequence_features(model, [[5, 6, 7]], feature_layers=[-1, 1])
    with pytest.raises(SystemExit, match="outside the base model's hidden states"):
        train_eagle.main([*argv[:-2], "--feature-layers", "7,-1", "--output", str(tmp_path / "o4")])


def test_the_rows_of_plain_steps_run_before_the_drafted_step_that_follows_them(monkeypatch):
    # run inside that step, their cost (growing with the plain run) was charged to drafting, and the step
    # chooser, judging each probe by it, kept a call plain to its end
    from hf_bpd.decode.call import DecodeCall

    pattern = iter([True, False, False, False, True, True, False, True] + [True] * 40)
    observed = []

    class Chooser:  # the steps drafted or plain as `pattern` says
        def draft_next(self):
            return next(pattern)

        def observe(self, drafted, tokens, seconds, expected=None):
            observed.append(drafted)

    monkeypatch.setattr(DecodeCall, "step_chooser", lambda self, *a, **k: Chooser())
    pending = []
    real = BlockDrafter.draft
    monkeypatch.setattr(
        BlockDrafter, "draft", lambda self, *a, **k: pending.append(len(self._pending)) or real(self, *a, **k)
    )
    model = tiny_model(eos_token_id=None)
    drafter = BlockDrafter(random_layer(model, std=0.1), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 9, 17, 3, 22]])
    assert torch.equal(
        greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter), greedy(model, ids, 30)
    )
    assert observed[:8] == [True, False, False, False, True, True, False, True]
    # after plain steps the context is caught up before the draft; after a drafted step its rows wait for it
    assert pending[:5] == [0, 0, 1, 0, 1]
    heads = BlockDrafter(random_heads(model), top_k=3)
    heads.catch_up_context()  # nothing for heads
    assert heads.stats.time_heads == 0


def test_a_layer_hands_what_it_does_not_serve_to_its_fallback_heads():
    # a default built on the layer must still decode batches and the captured step: with fallback heads it
    # does, exactly, and the call's stats are where the user reads them
    model = tiny_model(eos_token_id=None)
    heads = BlockDrafter(random_heads(model, std=0.1), top_k=3, max_tree_tokens=8)
    drafter = BlockDrafter(random_layer(model, std=0.1), top_k=3, max_tree_tokens=8, fallback=heads)
    batch = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    ours = greedy(model, batch, 20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert torch.equal(ours, greedy(model, batch, 20))
    assert drafter.stats is heads.stats and len(heads.stats.rows) == 2 and drafter._context.rows == 0
    row = batch[:1]
    extra_captured = {"cache_implementation": "static", "captured_step": True}
    for extra in (extra_captured, {}):
        ours = greedy(model, row, 20, custom_generate=hf_bpd.generate, assistant=drafter, **extra)
        assert torch.equal(ours, greedy(model, row, 20))
    # the last call, one row on a dynamic cache, is the layer's: it read the context
    assert drafter.stats is not heads.stats and drafter._context.rows > 0
    assert set(drafter.stats.tree_sizes) != {1}
    copy = drafter.with_rescorer(None)  # its own fallback too: calibration, lock and binding apart
    assert copy.fallback is not heads and copy.fallback.heads is heads.heads
    # fusion heads cannot take the captured step (a static cache): the refusal names both drafters
    fusion = BlockDraftHeads.for_base_model(model, num_heads=2, feature_layers=[1, -1])
    with_fusion = BlockDrafter(drafter.heads, top_k=3, fallback=BlockDrafter(fusion, top_k=3))
    with pytest.raises(ValueError, match="captured step drafts with heads; and its fallback: .*static cache"):
        greedy(model, row, 5, custom_generate=hf_bpd.generate, assistant=with_fusion, **extra_captured)
    with pytest.raises(ValueError, match="draft heads serve them all"):
        BlockDrafter(heads.heads, fallback=heads)
    with pytest.raises(ValueError, match="got an EAGLE layer"):
        BlockDrafter(drafter.heads, fallback=BlockDrafter(drafter.heads))
    with pytest.raises(TypeError, match="fallback must be a BlockDrafter"):
        BlockDrafter(drafter.heads, fallback=heads.heads)


def test_a_layer_s_fallback_heads_save_and_load_with_it(tmp_path):
    model = tiny_model()
    heads = random_heads(model)
    fallback = BlockDrafter(heads, top_k=5, max_tree_tokens=6, context_lookup=0)
    BlockDrafter(random_layer(model), top_k=4, fallback=fallback).save_pretrained(tmp_path / "drafter")
    loaded = BlockDrafter.from_pretrained(tmp_path / "drafter")
    assert loaded.reads_context and not loaded.fallback.reads_context
    assert fallback.settings() == loaded.fallback.settings()
    for a, b in zip(heads.state_dict().values(), loaded.fallback.heads.state_dict().values()):
        assert torch.equal(a, b)
    assert BlockDrafter.from_pretrained(tmp_path / "drafter", fallback=None).fallback is None
    from hf_bpd.drafting.corpus import CorpusIndex

    with_corpus = BlockDrafter(heads, corpus=CorpusIndex.from_answers([[5, 6]]))
    with pytest.raises(ValueError, match="no rescorer or corpus"):
        BlockDrafter(random_layer(model), fallback=with_corpus).save_pretrained(tmp_path / "other")


def test_drafting_runs_the_stacked_linears_as_training_runs_the_separate_ones_and_restacks_after_a_change():
    """Without autograd the layer runs q/k/v and gate/up stacked (`fused_weights`): the same predictions as the
    separate linears training runs, and stacked again once a weight changes in place."""
    model = tiny_model()
    layer = random_layer(model)
    tokens, features = sequence(9, model, 3)

    def both():
        with torch.no_grad():
            drafting = layer.unroll(features[None], tokens[None], 2)
        with torch.enable_grad():
            training = [p.detach() for p in layer.unroll(features[None], tokens[None], 2)]
        for a, b in zip(drafting, training):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return drafting

    before = both()
    with torch.no_grad():
        layer.k_proj.weight.mul_(2.0)
        layer.mlp.up_proj.weight.add_(0.1)
    after = both()
    assert not torch.allclose(before[1], after[1])


def test_context_vocab_drafts_the_context_s_tokens_outside_the_draft_vocabulary_in_one_softmax():
    """With context_vocab the layer's candidates are its draft vocabulary and the context's tokens outside it
    (each once, in the order they came), scored by the base model's LM-head rows in one softmax: the top-k
    and log-probabilities of the full vocabulary's logits restricted to those tokens."""
    model = tiny_model()
    vocab = model.config.vocab_size
    layer = random_layer(model)
    draft_vocab = torch.arange(0, vocab, 2)  # the even tokens
    narrow = EagleDraftLayer.for_base_model(model, draft_vocab=draft_vocab, start_as_identity=False)
    narrow.load_state_dict(layer.state_dict(), strict=False)
    narrow.eval()
    tokens, features = sequence(12, model, 4)
    tokens[3], tokens[7], tokens[9] = 11, 13, 11  # odd tokens in the context, one of them twice
    context = EagleContext(context_vocab=True)
    context.extend(narrow, features[:6], tokens[1:7])
    context.extend(narrow, features[6:11], tokens[7:12])
    odd = list(dict.fromkeys(t for t in tokens[1:12].tolist() if t % 2))
    assert context.vocab_extension.ids.tolist() == draft_vocab.tolist() + odd
    assert context.vocab.tokens == set(odd)
    lm_head = model.get_output_embeddings().weight
    with torch.no_grad():
        full = context.prediction @ lm_head.T
        allowed = torch.full_like(full, float("-inf"))
        allowed[:, draft_vocab] = full[:, draft_vocab]
        allowed[:, odd] = full[:, odd]
        expected_lp, expected_ids = allowed.log_softmax(-1).topk(5)
        ids, logprobs = narrow.top_tokens(context.prediction, 5, context.vocab_extension)
    assert ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(logprobs, expected_lp, rtol=1e-5, atol=1e-5)
    tree, _ = grow_tree(narrow, context, int(tokens[11]), top_k=5, budget=40)
    assert set(tree.tokens[1:]) & set(odd)  # the tree drafts context tokens the draft vocabulary lacks
    plain = EagleContext()
    plain.extend(narrow, features[:11], tokens[1:12])
    assert plain.vocab_extension is None
    tree, _ = grow_tree(narrow, plain, int(tokens[11]), top_k=5, budget=40)
    assert all(t % 2 == 0 for t in tree.tokens[1:])


def test_context_vocab_decodes_greedy_s_tokens_saves_with_the_drafter_and_is_refused_for_lattice_heads(tmp_path):
    model = tiny_model(eos_token_id=None)
    layer = random_layer(model, std=0.1)
    narrow = EagleDraftLayer.for_base_model(model, draft_vocab=torch.arange(0, 97, 3), start_as_identity=False)
    narrow.load_state_dict(layer.state_dict(), strict=False)
    narrow.eval()
    ids = torch.tensor([[5, 10, 17, 4, 22, 31]])
    drafter = BlockDrafter(narrow, top_k=3, max_tree_tokens=10, context_vocab=True)
    ours = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter)
    assert torch.equal(ours, greedy(model, ids, 30))
    assert drafter._context.vocab_extension is not None
    drafter.save_pretrained(tmp_path)
    assert BlockDrafter.from_pretrained(tmp_path).context_vocab is True
    with pytest.raises(ValueError, match="context_vocab must be True or False"):
        BlockDrafter(narrow, context_vocab="yes")
    with pytest.raises(ValueError, match="context_vocab: it serves EAGLE layers and heads that read the drafted"):
        BlockDrafter(random_heads(model), context_vocab=True)
