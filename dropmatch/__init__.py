"""DropMatch: training-free MC-dropout token acceptance for speculative decoding (arXiv 2603.03333).

Public API::

    from dropmatch import load_pair, Decoder, MethodConfig, SamplingConfig
    pair = load_pair("gemma-3-270m")                       # or load_pair(None, target=ID, draft=ID)
    decoder = Decoder(pair, MethodConfig("dropmatch", k=5, p_drop=0.3, criterion="js+majority"))
    result = decoder.generate("Question: ...", max_new_tokens=64)
    result.token_ids, result.stats.tau, result.stats.tokens_per_s
"""

from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from .engine import GenerationResult, generate
from .errors import (
                     ConfigError,
                     DataError,
                     DropMatchError,
                     ModelNotFoundError,
                     PromptTooLongError,
                     VocabularyMismatchError,
)
from .heads import DropoutHead
from .methods import METHODS, Decoder, MethodConfig, build_drafter, build_rule
from .models import CausalLM, ModelPair, load_pair, tiny_pair
from .rules import (
                     CRITERIA,
                     DivergenceThreshold,
                     DropMatch,
                     RelaxedVerification,
                     StandardVerification,
                     TopK,
                     TypicalAcceptance,
                     Verdict,
                     VerificationRule,
                     VerifyInput,
)
from .sampling import SamplingConfig
from .stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "CRITERIA", "METHODS", "CausalLM", "ConfigError", "DataError", "Decoder", "DivergenceThreshold", "Draft",
    "Drafter", "DropMatch", "DropMatchError", "DropoutHead", "GenerationResult", "GenerationStats",
    "MethodConfig", "ModelDrafter", "ModelNotFoundError", "ModelPair", "NgramDrafter", "PromptTooLongError",
    "RelaxedVerification", "SamplingConfig", "StandardVerification", "TopK", "TypicalAcceptance", "Verdict",
    "VerificationRule", "VerifyInput", "VocabularyMismatchError", "build_drafter", "build_rule", "generate",
    "load_pair", "tiny_pair",
]
