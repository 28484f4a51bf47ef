"""Whether two things speak the same token ids: the one place for vocabulary and tokenizer identity."""

from __future__ import annotations

import hashlib
import json


def model_vocab_size(model) -> int:
    """Rows of the model's output embedding: the token ids it scores."""
    return model.get_output_embeddings().weight.shape[0]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id), so files can record which one they used."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def check_same_tokenizer(a, b, what: str = "rescorer LM") -> None:
    """Raise if two tokenizers map any token to different ids."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = next((t for t in va if vb.get(t) != va[t]), None) or next(t for t in vb if t not in va)
        raise ValueError(
            f"the {what} uses another tokenizer than the base model ({len(va)} vs {len(vb)} tokens; "
            f"token {diff!r} differs): the rescorer must share the base model's tokenizer"
        )
