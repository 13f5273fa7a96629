"""specdec: lossless speculative decoding for Hugging Face causal LMs over a shared paged KV cache."""
from . import zoo
from .api import SpecModel, generate, hf_custom_generate, wrap
from .policy import AcceptanceTracker, DraftPolicy
from .quantize import int4_draft, int8_draft
from .stats import SpecStats
from .tree import TreeSpec

__all__ = ["zoo", "TreeSpec", "generate", "wrap", "hf_custom_generate", "GenerateOutput", "SpecModel", "SpecStats",
           "int8_draft", "int4_draft", "AcceptanceTracker", "DraftPolicy"]
__version__ = "0.1.0"


def __getattr__(name):  # GenerateOutput (specdec/output.py) imports transformers' generation utilities: on first use
    if name == "GenerateOutput":
        from .output import GenerateOutput

        return GenerateOutput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
