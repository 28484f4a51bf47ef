"""Head training on a tiny model: loss falls, heads reload bit-identical, joint LoRA reloads and drafts,
distillation resumes without redoing or duplicating samples."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import tiny_distilled, tiny_model

import hf_bpd
from hf_bpd.training import distill, objective, train_heads
from hf_bpd.training.objective import IGNORE, agreeing_targets, head_targets

datasets = pytest.importorskip("datasets")


def args_for(tmp_path, **kw):
    parser = argparse.ArgumentParser()
    train_heads.add_args(parser)
    base = ["--data", "unused", "--output", str(tmp_path), "--no-progress", "--log-every", "0"]
    for k, v in kw.items():
        flag = f"--{k.replace('_', '-')}"
        base += [flag] if v is True else [flag, str(v)]  # store_true flags take no value
    return parser.parse_args(base)


def saved_previous_heads(model, data, tmp_path, settings: dict):
    """Three "previous" heads trained on `data`, saved in `tmp_path / "first_heads"` for `--init`."""
    first, log = train_heads.train_frozen(
        model, data, args_for(tmp_path / "first", num_heads=3, token_input="previous", **settings)
    )
    first.save_pretrained(tmp_path / "first_heads")
    return first, log


def assert_lossless(model, data, heads) -> None:
    """Decoding the first sample's prompt with `heads` gives plain greedy's tokens."""
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()


def test_head_targets_shift():
    t = head_targets([10, 11, 12, 13, 14], start=1, num_heads=2)
    # positions 1, 2, 3: head 1 -> token at t+2, head 2 -> token at t+3
    assert t.tolist() == [[13, 14], [14, IGNORE], [IGNORE, IGNORE]]


def test_agreeing_targets_are_the_greedy_continuation_where_the_prompt_agrees():
    seq = [5, 6, 7, 8, 10, 11, 12, 13]  # a prompt of 4 tokens, then the model's greedy answer 10 11 12 13
    greedy = torch.tensor([6, 9, 8])  # the model's choice of token t+1 at prompt positions 0, 1, 2
    t = agreeing_targets(seq, 3, greedy, num_heads=3)
    # t=0: the text's 6 is the model's choice, so head 1 drafts its next choice (9); head 2 would need the
    # text's 7 to be the model's choice at t=1, which it is not. t=1 disagrees at once. t=2 agrees from there on.
    assert t[:3].tolist() == [[9, IGNORE, IGNORE], [IGNORE] * 3, [10, 11, 12]]
    assert torch.equal(t[3:], head_targets(seq, 3, 3))  # the answer's positions: as without prompt positions


def test_prompt_positions_add_teacher_forced_rows_with_greedy_targets():
    """`compute_features(prompt_positions=True)`: the answers' rows are exactly those of the default features,
    and each prompt row's target for head i is the model's greedy continuation from there, valid exactly where
    the prompt's tokens t+1..t+i are that continuation's first i tokens (checked against `generate`)."""
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=3, prompt_len=4, new=10)
    # prompts that partly agree with the model: a random start, the model's own continuation, random tokens
    rows = {"id": [], "prompt_ids": [], "response_ids": []}
    g = torch.Generator().manual_seed(3)
    for i, row in enumerate(data):
        own = row["prompt_ids"] + row["response_ids"][:5] + torch.randint(3, 97, (3,), generator=g).tolist()
        answer = model.generate(torch.tensor([own]), do_sample=False, max_new_tokens=8)[0, len(own) :].tolist()
        rows["id"].append(str(i))
        rows["prompt_ids"].append(own)
        rows["response_ids"].append(answer)
    import datasets

    data = datasets.Dataset.from_dict(rows)
    plain = train_heads.compute_features(model, data, 3, progress=False)
    full = train_heads.compute_features(model, data, 3, progress=False, prompt_positions=True)
    answers = ~full.in_prompt
    assert not plain.in_prompt.any() and int(full.in_prompt.sum()) > 0
    for name in ("hidden", "targets", "next_token", "sample"):
        assert torch.equal(getattr(full, name)[answers], getattr(plain, name)), name
    fused = train_heads.compute_features(model, data, 3, progress=False, prompt_positions=True, feature_layers=[1, -1])
    assert torch.equal(fused.targets, full.targets)  # the greedy choices read from the fusion's final slice
    checked = 0
    for j, row in enumerate(data):
        seq = row["prompt_ids"] + row["response_ids"]
        mine = (full.sample == j) & full.in_prompt
        for t, target in enumerate(full.targets[mine].tolist()):
            cont = model.generate(torch.tensor([seq[: t + 1]]), do_sample=False, max_new_tokens=4)[0, t + 1 :]
            for i in range(1, 4):
                agrees = seq[t + 1 : t + 1 + i] == cont[:i].tolist() and t + 1 + i < len(seq)
                assert target[i - 1] == (int(cont[i]) if agrees else IGNORE), (j, t, i)
                checked += agrees
    assert checked >= 3  # the own continuations inside the prompts were found


def test_training_on_prompt_positions_keeps_validation_on_the_answers(tmp_path):
    """`--prompt-positions`: the features are cached in a folder of their own, validation reads the same
    answer positions as a run without them, the heads learn and decode losslessly; a context-copy pointer
    is refused before any feature is computed."""
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=12)
    settings = dict(epochs=1, lr=3e-2, batch_size=64, val_fraction=0.25, top_k=3, num_heads=2)
    _, plain_log = train_heads.train_frozen(model, data, args_for(tmp_path / "plain", **settings))
    args = args_for(tmp_path / "prompts", prompt_positions=True, **settings)
    heads, log = train_heads.train_frozen(model, data, args)
    assert log[0]["positions"] == plain_log[0]["positions"]
    assert list((tmp_path / "prompts" / "features" / "with-prompts").glob("features-*.pt"))
    assert not list((tmp_path / "prompts" / "features").glob("features-*.pt"))
    assert_lossless(model, data, heads)
    with pytest.raises(ValueError, match="--prompt-positions"):
        train_heads.train_frozen(
            model, data, args_for(tmp_path / "x", prompt_positions=True, copy_dim=8, token_input="previous")
        )
    assert not (tmp_path / "x" / "features").exists()


def test_feature_cache_resumes_and_only_computes_new_samples(tmp_path, monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=12, new=8)
    whole = train_heads.compute_features(model, data, 2, progress=False)
    # token t+1 beside each position's hidden state: the response token the base model chose
    first = data[0]["prompt_ids"] + data[0]["response_ids"]
    start = objective.response_positions(len(data[0]["prompt_ids"]))
    n0 = int((whole.sample == 0).sum())
    assert whole.next_token[:n0].tolist() == first[start + 1 : start + 1 + n0]
    computed = []
    real = train_heads.compute_features

    def counting(model, rows, *a, **kw):
        computed.append(len(rows))
        return real(model, rows, *a, **kw)

    monkeypatch.setattr(train_heads, "compute_features", counting)
    cache = tmp_path / "features"
    got = train_heads.cached_features(model, data.select(range(8)), 2, cache, chunk=5, progress=False)
    assert computed == [5, 3] and sorted(p.name for p in cache.iterdir()) == [
        "features-0000000-0000005.pt",
        "features-0000005-0000008.pt",
    ]
    computed.clear()
    got = train_heads.cached_features(model, data, 2, cache, chunk=5, progress=False)  # the data set grew
    assert computed == [4]  # samples 8..11 only
    for f in ("hidden", "targets", "next_token", "sample"):
        assert torch.equal(getattr(got, f), getattr(whole, f)), f
    computed.clear()
    other = tiny_distilled(model, n=12, new=8, seed=1)  # other samples: no chunk is reused
    train_heads.cached_features(model, other, 2, cache, chunk=5, progress=False)
    assert computed == [5, 5, 2]
    computed.clear()
    train_heads.cached_features(model, other, 3, cache, chunk=5, progress=False)  # more heads than cached
    assert sum(computed) == 12


def test_teacher_rows_hold_the_base_models_distribution_over_each_heads_target():
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=6, new=10)
    feats = train_heads.compute_features(model, data, 3, progress=False)
    rows = train_heads.teacher_rows(feats, 3)
    # a target exactly where a teacher row exists, and the teacher row is of the same sample
    assert torch.equal(rows >= 0, feats.targets != IGNORE)
    has = rows >= 0
    assert torch.equal(feats.sample[rows[has]], feats.sample[:, None].expand_as(rows)[has])
    # the distilled token is greedy: the argmax of the base model's logits at the teacher row
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3)
    choice = heads.base_logits(feats.hidden[rows[has]].float()).argmax(-1)
    assert torch.equal(choice, feats.targets[has])


def test_teacher_loss_is_the_cross_entropy_against_the_base_distribution():
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=1)
    teacher = torch.randn(5, heads.config.hidden_size)
    teacher[3] = float("nan")  # no teacher: left out of the mean
    logits = torch.randn(5, heads.config.vocab_size)
    p = heads.base_logits(teacher[[0, 1, 2, 4]]).softmax(-1)
    want = -(p * logits[[0, 1, 2, 4]].log_softmax(-1)).sum(-1).mean()
    assert torch.allclose(objective.teacher_loss(heads, logits, teacher), want)
    # a head that already outputs the base distribution has the smallest loss: the teacher's entropy
    same = heads.base_logits(teacher.nan_to_num())
    entropy = -(p * p.log()).sum(-1).mean()
    assert torch.allclose(objective.teacher_loss(heads, same, teacher), entropy, atol=1e-5)


def test_frozen_training_with_teacher_weight_loss_falls_and_drafts_losslessly(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    args = args_for(tmp_path, num_heads=2, epochs=20, lr=3e-2, batch_size=64, val_fraction=0.2, teacher_weight=0.5)
    heads, history = train_heads.train_frozen(model, data, args)
    losses = [r["train_loss"] for r in history]
    assert losses[-1] < 0.8 * losses[0]
    assert history[-1]["top1"][0] > 2 * history[0]["top1"][0]  # held-out accuracy rises with it
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()


def test_frozen_training_loss_falls_and_reloads_bit_identical(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    args = args_for(
        tmp_path, num_heads=2, epochs=30, lr=3e-2, batch_size=64, val_fraction=0.2, top_k=3, draft_vocab_size=64
    )
    heads, history = train_heads.train_frozen(model, data, args)
    assert heads.config.token_input == "previous"  # the default: head i reads the token before its target
    losses = [r["train_loss"] for r in history]
    assert losses[-1] < 0.8 * losses[0]
    assert len(history[-1]["top1"]) == 2 and 0.0 <= history[-1]["oracle_top3"] <= 2.0
    heads.save_pretrained(tmp_path / "heads")
    again = hf_bpd.BlockDraftHeads.from_pretrained(tmp_path / "heads").bind(model)
    assert heads.config.draft_vocab_size == 64 and torch.equal(again.draft_vocab, heads.draft_vocab)
    for (name, a), (_, b) in zip(sorted(heads.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name
    # the trained heads decode losslessly
    drafter = hf_bpd.BlockDrafter(again, top_k=3, max_tree_tokens=8)
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()


def test_init_continues_from_saved_heads_keeping_their_shape_and_draft_vocabulary(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    settings = dict(epochs=4, lr=3e-2, batch_size=64, val_fraction=0.2, top_k=3)
    first, first_log = train_heads.train_frozen(
        model, data, args_for(tmp_path / "first", num_heads=2, draft_vocab_size=64, token_input="next", **settings)
    )
    first.save_pretrained(tmp_path / "first_heads")
    # the shape arguments are left out: they come from the --init heads, and so does the draft vocabulary,
    # though more data would pick another one
    more = tiny_distilled(model, n=32, seed=1)
    args = args_for(tmp_path / "more", init=tmp_path / "first_heads", **settings)
    heads, log = train_heads.train_frozen(model, more, args)
    assert (args.num_heads, args.num_layers, args.token_input, args.draft_vocab_size) == (2, 1, "next", 64)
    assert heads.config.token_input == "next" and torch.equal(heads.draft_vocab, first.draft_vocab)
    assert not same_weights(heads, first)  # trained further ...
    fresh, fresh_log = train_heads.train_frozen(
        model, more, args_for(tmp_path / "fresh", num_heads=2, draft_vocab_size=64, token_input="next", **settings)
    )
    assert log[0]["train_loss"] < fresh_log[0]["train_loss"]  # ... from where the saved heads were, not anew
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    # continuing cannot change the heads' shape, and heads of another base model are refused
    with pytest.raises(ValueError, match="--num-heads 3 differs from the --init heads"):
        train_heads.train_frozen(model, more, args_for(tmp_path / "x", init=tmp_path / "first_heads", num_heads=3))
    with pytest.raises(ValueError, match="--token-input previous differs"):
        train_heads.train_frozen(
            model, more, args_for(tmp_path / "x", init=tmp_path / "first_heads", token_input="previous")
        )
    other = tiny_model("llama", seed=1, eos_token_id=None)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        train_heads.train_frozen(other, more, args_for(tmp_path / "y", init=tmp_path / "first_heads", epochs=1))
    with pytest.raises(ValueError, match="no readable draft-heads config"):
        train_heads.train_frozen(model, more, args_for(tmp_path / "z", init=tmp_path / "nowhere", epochs=1))


@pytest.mark.parametrize("chain", ["state", "beside"])
def test_chained_training_from_unchained_heads_trains_the_chain_and_decodes_losslessly(tmp_path, chain):
    """`--chain --init` unchained "previous" heads: the saved heads are chained, start from those weights
    ("beside": drafting exactly as they did), learn, and decode losslessly; a fresh chained run too."""
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    settings = dict(epochs=3, lr=3e-2, batch_size=64, val_fraction=0.2, top_k=3)
    first, first_log = saved_previous_heads(model, data, tmp_path, settings)
    args = args_for(tmp_path / "chained", init=tmp_path / "first_heads", chain=chain, **settings)
    heads, log = train_heads.train_frozen(model, data, args)
    assert heads.config.chain == chain and not first.chained
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    if chain == "beside":  # continues from the unchained heads' behaviour, not from a worse start
        assert log[0]["train_loss"] < first_log[0]["train_loss"]
    fresh, _ = train_heads.train_frozen(
        model, data, args_for(tmp_path / "fresh", num_heads=3, token_input="previous", chain=chain, **settings)
    )
    assert fresh.config.chain == chain
    for trained in (heads, fresh):
        assert_lossless(model, data, trained)
    with pytest.raises(ValueError, match="previous"):
        train_heads.train_frozen(model, data, args_for(tmp_path / "x", num_heads=2, token_input="next", chain=chain))


def test_deeper_heads_continue_from_shallower_init_heads(tmp_path):
    """`--num-layers` above the `--init` heads' deepens them: the new blocks start as the identity, so training
    starts where the saved heads are (not anew), the new blocks learn, and decoding stays lossless; fewer
    blocks than theirs is refused before any feature is computed."""
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    settings = dict(epochs=2, lr=3e-2, batch_size=64, val_fraction=0.2, top_k=3)
    saved_previous_heads(model, data, tmp_path, settings)
    args = args_for(tmp_path / "deeper", init=tmp_path / "first_heads", num_layers=2, **settings)
    heads, log = train_heads.train_frozen(model, data, args)
    assert heads.config.num_layers == 2 and args.num_layers == 2
    assert all(heads.heads[i][1].linear.weight.abs().sum() > 0 for i in range(3))  # the new blocks learned
    fresh, fresh_log = train_heads.train_frozen(
        model, data, args_for(tmp_path / "fresh", num_heads=3, num_layers=2, token_input="previous", **settings)
    )
    assert log[0]["train_loss"] < fresh_log[0]["train_loss"]
    assert_lossless(model, data, heads)
    heads.save_pretrained(tmp_path / "deeper_heads")
    with pytest.raises(ValueError, match="--num-layers 1 differs from the --init heads"):
        train_heads.train_frozen(model, data, args_for(tmp_path / "x", init=tmp_path / "deeper_heads", num_layers=1))


def test_joint_training_continues_frozen_heads_with_a_draft_vocabulary(tmp_path):
    """Medusa-2's recipe: heads trained frozen first, then jointly with LoRA from there."""
    pytest.importorskip("peft")
    from hf_bpd.training.joint import train_joint

    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=8)
    frozen, _ = train_heads.train_frozen(
        model, data, args_for(tmp_path / "frozen", num_heads=2, draft_vocab_size=64, epochs=2, val_fraction=0.25)
    )
    frozen.save_pretrained(tmp_path / "frozen_heads")
    args = args_for(tmp_path / "joint", mode="joint", init=tmp_path / "frozen_heads", epochs=1, batch_size=4, lora_r=4)
    heads, history = train_joint(model, data, args)
    assert heads.num_heads == 2 and torch.equal(heads.draft_vocab, frozen.draft_vocab)
    assert torch.isfinite(torch.tensor(history[0]["train_loss"])) and not same_weights(heads, frozen)


class Interrupted(Exception):
    """Stands for a Ctrl-C in the middle of an epoch."""


def interrupt_after(monkeypatch, module, calls: int) -> None:
    """Make `module.heads_loss` raise on its call number `calls` + 1, as a Ctrl-C in mid-epoch would."""
    real, seen = module.heads_loss, []

    def loss(*a, **kw):
        seen.append(1)
        if len(seen) > calls:
            raise Interrupted
        return real(*a, **kw)

    monkeypatch.setattr(module, "heads_loss", loss)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def without_seconds(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in history]


def test_frozen_training_interrupted_resumes_to_the_same_weights(tmp_path, monkeypatch):
    from hf_bpd.training.checkpoint import latest_checkpoint, read_run

    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model)
    settings = dict(num_heads=2, epochs=3, lr=3e-2, batch_size=64, val_fraction=0.2, teacher_weight=0.5)
    straight, straight_log = train_heads.train_frozen(model, data, args_for(tmp_path / "straight", **settings))
    steps_per_epoch = 10  # 24 samples x 26 positions, 80 % of them in batches of 64
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        interrupt_after(m, train_heads, steps_per_epoch + 4)  # in the middle of epoch 1
        with pytest.raises(Interrupted):
            train_heads.train_frozen(model, data, args_for(out, **settings))
    assert read_run(latest_checkpoint(out))["epochs_done"] == 1  # accelerate's state of epoch 1 and run.json
    resumed, resumed_log = train_heads.train_frozen(model, data, args_for(out, **settings))
    assert same_weights(resumed, straight)  # bit for bit: same shuffle order, optimizer and schedule
    assert without_seconds(resumed_log) == without_seconds(straight_log)
    # a finished run re-run trains nothing more and returns the same heads
    again, _ = train_heads.train_frozen(model, data, args_for(out, **settings))
    assert same_weights(again, straight)
    # another setting, or other data, is refused by name rather than mixed into this run
    with pytest.raises(ValueError, match="lr differ"):
        train_heads.train_frozen(model, data, args_for(out, **{**settings, "lr": 1e-2}))
    with pytest.raises(ValueError, match="data differ"):
        train_heads.train_frozen(model, tiny_distilled(model, seed=1), args_for(out, **settings))
    (latest_checkpoint(out) / "run.json").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable train-heads checkpoint"):
        train_heads.train_frozen(model, data, args_for(out, **settings))


def test_joint_training_interrupted_resumes_to_the_same_heads_and_adapter(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from hf_bpd.training import joint

    data = tiny_distilled(tiny_model("llama", eos_token_id=None), n=8)

    def run(out, interrupt: int = 0):
        args = args_for(out, mode="joint", num_heads=2, epochs=2, lr=1e-3, batch_size=4, lora_r=4)
        with monkeypatch.context() as m:
            if interrupt:
                interrupt_after(m, joint, interrupt)
            heads, history = joint.train_joint(tiny_model("llama", eos_token_id=None), data, args)
        return heads, history, load_file(out / "lora" / "adapter_model.safetensors")

    heads, history, adapter = run(tmp_path / "straight")
    with pytest.raises(Interrupted):
        run(tmp_path / "resumed", interrupt=3)  # 2 batches an epoch: in epoch 1
    heads2, history2, adapter2 = run(tmp_path / "resumed")
    assert same_weights(heads2, heads)
    assert adapter.keys() == adapter2.keys() and all(torch.equal(adapter[k], adapter2[k]) for k in adapter)
    assert without_seconds(history2) == without_seconds(history)


def test_joint_lora_checkpoint_reloads_and_drafts(tmp_path):
    pytest.importorskip("peft")
    from hf_bpd.training.joint import train_joint

    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=8)
    args = args_for(tmp_path, mode="joint", num_heads=2, epochs=2, lr=1e-3, batch_size=4, lora_r=4)
    heads, history = train_joint(model, data, args)
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in history)
    heads.save_pretrained(tmp_path)
    assert not any("lora" in n for n, _ in model.named_parameters())  # the base model was left untouched
    merged, drafter = hf_bpd.load_joint_model(tiny_model("llama", eos_token_id=None), tmp_path, top_k=3)
    assert drafter.num_heads == 2
    ids = torch.tensor([[5, 6, 7]])
    ref = merged.generate(ids, do_sample=False, max_new_tokens=16)
    out = merged.generate(ids, do_sample=False, max_new_tokens=16, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist() and drafter.stats.steps >= 1
    with pytest.raises(FileNotFoundError, match="LoRA"):
        hf_bpd.load_joint_model(merged, tmp_path / "nowhere")


class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [3 + (ord(c) % 90) for c in messages[0]["content"]][:8]


def test_distill_interrupted_and_restarted_finishes_without_duplicates(tmp_path, monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    prompts = [(str(i), f"prompt number {i}") for i in range(10)]
    calls = {"n": 0}
    real_generate = model.generate

    def flaky_generate(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # interrupted during the third batch
        return real_generate(*a, **kw)

    monkeypatch.setattr(model, "generate", flaky_generate)
    with pytest.raises(KeyboardInterrupt):
        distill.distill(
            model, FakeTokenizer(), prompts, tmp_path, max_new_tokens=4, batch_size=2, shard_size=4, progress=False
        )
    done_before = distill.done_ids(tmp_path / "shards")
    assert done_before == {"0", "1", "2", "3"}  # only the finished shard was written
    monkeypatch.setattr(model, "generate", real_generate)
    calls["n"] = 0
    path = distill.distill(
        model, FakeTokenizer(), prompts, tmp_path, max_new_tokens=4, batch_size=2, shard_size=4, progress=False
    )
    data = datasets.load_from_disk(str(path))
    assert sorted(data["id"], key=int) == [str(i) for i in range(10)]  # each prompt exactly once
    assert all(len(r) == 4 for r in data["response_ids"])
    fresh = distill.distill(
        model,
        FakeTokenizer(),
        prompts,
        tmp_path / "fresh",
        max_new_tokens=4,
        batch_size=2,
        shard_size=4,
        progress=False,
    )
    by_id = {r["id"]: r["response_ids"] for r in datasets.load_from_disk(str(fresh))}
    assert all(by_id[r["id"]] == r["response_ids"] for r in data)  # resumed data equals uninterrupted data
    assert json.dumps(sorted(by_id)) == json.dumps(sorted(data["id"]))
    assert distill.data_digest(data) == distill.data_digest(datasets.load_from_disk(str(fresh)))


def test_data_digest_ignores_row_order_and_sees_every_token():
    """The digest `ship` records beside the shipped heads: a rerun of the recipe checks against it."""
    data = datasets.Dataset.from_dict(
        {"id": ["0", "1", "2"], "prompt_ids": [[5, 6], [7], [8, 9]], "response_ids": [[1, 2, 3], [4], [5, 6]]}
    )
    summary = distill.data_digest(data)
    assert summary["num_samples"] == 3 and summary["num_response_tokens"] == 6
    assert distill.data_digest(data.select([2, 0, 1])) == summary  # shard order and batching do not matter
    changed = data.map(lambda r: {"response_ids": [4, 2, 3] if r["id"] == "0" else r["response_ids"]})
    assert distill.data_digest(changed)["sha256"] != summary["sha256"]
    assert distill.data_digest(data.select([0, 1]))["sha256"] != summary["sha256"]


def test_distill_offset_continues_a_closed_run_without_overlap(tmp_path):
    """`--offset N` after a run closed with `--limit N`: the same seeded order, the prompts after N."""
    rows = [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(10)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = distill.load_prompts(str(path), "prompt", "id", None, seed=0)
    first = distill.load_prompts(str(path), "prompt", "id", 4, seed=0)
    rest = distill.load_prompts(str(path), "prompt", "id", None, seed=0, offset=4)
    assert first + rest == whole and first == whole[:4]
    assert distill.load_prompts(str(path), "prompt", "id", 3, seed=0, offset=4) == whole[4:7]
    assert distill.load_prompts(str(path), "prompt", "id", None, seed=0, offset=10) == []
    with pytest.raises(ValueError, match="offset 11 is past the 10 prompts"):
        distill.load_prompts(str(path), "prompt", "id", None, seed=0, offset=11)
    with pytest.raises(ValueError, match="offset and limit must be >= 0"):
        distill.load_prompts(str(path), "prompt", "id", None, seed=0, offset=-1)


class FakeAccelerator:
    """Two processes whose replicas hold `checksums`."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, checksums):
        self.checksums = checksums

    def gather(self, _):
        return torch.stack(self.checksums)


def test_diverged_data_parallel_replicas_raise():
    module = torch.nn.Linear(3, 2)
    mine = torch.stack([p.detach().double().sum() for p in module.parameters()])
    objective.check_replicas_agree(FakeAccelerator([mine, mine.clone()]), module)
    with pytest.raises(RuntimeError, match="diverged"):
        objective.check_replicas_agree(FakeAccelerator([mine, mine + 1]), module)


@pytest.mark.parametrize("mode", ["frozen", "joint"])
def test_data_parallel_training_under_torchrun(tmp_path, mode):
    """The same script on 2 processes (CPU, gloo): gradients are synchronised (replicas are checked after
    every epoch and would raise), only the main process writes, and the saved heads load and draft."""
    import os
    import subprocess
    import sys

    if mode == "joint":
        pytest.importorskip("peft")
    model = tiny_model("llama", eos_token_id=None)
    model.save_pretrained(tmp_path / "model")
    tiny_distilled(model, n=16).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "hf_bpd.training.train_heads",
    ]
    cmd += ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--output", str(out)]
    cmd += ["--mode", mode, "--num-heads", "2", "--epochs", "2", "--no-progress", "--log-every", "0"]
    cmd += ["--batch-size", "16", "--lr", "3e-2"] if mode == "frozen" else ["--batch-size", "2", "--lora-r", "4"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((out / "training_log.json").read_text())
    assert [r["processes"] for r in log["epochs"]] == [2, 2]
    assert done.stdout.count("saved heads to") == 1  # the main process alone writes
    heads = hf_bpd.BlockDraftHeads.from_pretrained(out).bind(model)
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=12)
    got = model.generate(ids, do_sample=False, max_new_tokens=12, custom_generate=hf_bpd.generate, assistant=drafter)
    assert got.tolist() == ref.tolist()


def test_load_distilled_concatenates_several_runs_in_order(tmp_path):
    for name, ids in (("a", ["0", "1"]), ("b", ["instr-0"])):
        shards = tmp_path / name / "shards"
        shards.mkdir(parents=True)
        rows = {"id": ids, "prompt_ids": [[1, 2]] * len(ids), "response_ids": [[3]] * len(ids)}
        distill.write_shard(shards, rows)
    both = distill.load_distilled([tmp_path / "a", tmp_path / "b"])
    assert both["id"] == ["0", "1", "instr-0"] and both.column_names == ["id", "prompt_ids", "response_ids"]
    assert distill.load_distilled([tmp_path / "b"])["id"] == ["instr-0"]
    args = args_for(tmp_path)  # train-heads takes several --data folders
    parser = argparse.ArgumentParser()
    train_heads.add_args(parser)
    assert parser.parse_args(["--data", "x", "y", "--output", "o"]).data == ["x", "y"]
    assert args.data == ["unused"]


def test_cached_head_features_keep_values_beyond_float16_in_bfloat16_and_join_chunks_of_both():
    fits, beyond = torch.tensor([[1.5, -2.0]]), torch.tensor([[1e6, 3.0]])
    assert train_heads.stored_features(fits).dtype == torch.float16
    assert train_heads.stored_features(beyond).dtype == torch.bfloat16
    parts = [
        train_heads.Features(
            train_heads.stored_features(x),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.bool),
        )
        for x in (fits, beyond)
    ]
    joined = train_heads.Features.concat(parts).hidden
    assert joined.dtype == torch.bfloat16 and torch.isfinite(joined).all()
    assert joined.float().tolist() == [[1.5, -2.0], [999424.0, 3.0]]  # 1e6 at bfloat16's step


def test_a_cached_head_features_chunk_holding_inf_is_computed_again(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=6, new=8)
    cache = tmp_path / "features"
    whole = train_heads.cached_features(model, data, 2, cache, chunk=3, progress=False)
    path = cache / "features-0000000-0000003.pt"
    saved = torch.load(path)
    saved["hidden"][0, 0] = float("inf")  # as float16 stored a state beyond its range before `stored_features`
    torch.save(saved, path)
    again = train_heads.cached_features(model, data, 2, cache, chunk=3, progress=False)
    assert torch.equal(again.hidden, whole.hidden) and torch.isfinite(torch.load(path)["hidden"]).all()


def test_heads_training_stops_at_a_non_finite_loss(tmp_path, monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    data = tiny_distilled(model, n=8)
    feats = train_heads.cached_features(model, data, 2, tmp_path / "cache", progress=False)
    feats.hidden[:] = float("inf")  # as a model computing in float16 can give
    monkeypatch.setattr(train_heads, "cached_features", lambda *a, **kw: feats)
    args = args_for(tmp_path / "run", epochs=1, lr=3e-2, batch_size=64, num_heads=2)
    with pytest.raises(FloatingPointError, match="epoch 0 step 1: the loss is nan; training stopped before this step"):
        train_heads.train_frozen(model, data, args)
