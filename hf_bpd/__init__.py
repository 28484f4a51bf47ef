"""hf_bpd: lossless blockwise parallel decoding (Kim et al., 2024) as a transformers plugin."""

from .cpu.packed_linear import fast_cpu
from .decode.binding import prepare
from .decode.stats import DecodingStats
from .drafting.corpus import CorpusIndex
from .drafting.drafter import BlockDrafter, Rescorer
from .drafting.heads import BlockDraftHeads, BlockDraftHeadsConfig
from .drafting.joint import load_joint_model
from .drafting.lattice import Lattice, ScoredPath
from .drafting.rescoring.composed import ComposedRescorer
from .drafting.rescoring.neural import NeuralRescorer
from .drafting.rescoring.ngram import ContextNgram, NgramLM, NgramRescorer
from .drafting.tree import DraftTree
from .generation import generate
from .io.packaged import load_packaged_drafter, load_packaged_model, packaged_rescorers

__version__ = "0.1.0"

__all__ = [
    "BlockDraftHeads",
    "BlockDraftHeadsConfig",
    "BlockDrafter",
    "ComposedRescorer",
    "ContextNgram",
    "CorpusIndex",
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
    "prepare",
]
