"""hf_bpd: lossless blockwise parallel decoding (Kim et al., 2024) as a transformers plugin."""

from .drafter import BlockDrafter, Rescorer
from .generation import generate
from .heads import BlockDraftHeads, BlockDraftHeadsConfig
from .joint import load_joint_model
from .lattice import Lattice, ScoredPath
from .packaged import load_packaged_drafter, load_packaged_model, packaged_rescorers
from .packed_linear import fast_cpu
from .rescoring.composed import ComposedRescorer
from .rescoring.neural import NeuralRescorer
from .rescoring.ngram import ContextNgram, NgramLM, NgramRescorer
from .stats import DecodingStats
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "BlockDraftHeads",
    "BlockDraftHeadsConfig",
    "BlockDrafter",
    "ComposedRescorer",
    "ContextNgram",
    "DecodingStats",
    "DraftTree",
    "Lattice",
    "NeuralRescorer",
    "NgramLM",
    "NgramRescorer",
    "Rescorer",
    "ScoredPath",
    "fast_cpu",
    "generate",
    "load_joint_model",
    "load_packaged_drafter",
    "load_packaged_model",
    "packaged_rescorers",
]
