"""Speculative decoding over kvopt caches (single sequence): proposers, exact verification, rollback.

    out = kvopt.generate(model, ids, cache="kivi:bits=4", speculate="prompt_lookup:k=4", max_new_tokens=128)
    out.tokens, out.stats.acceptance_rate, out.decode_tokens_per_second
"""

from kvopt.speculative.draft_model import DraftModel
from kvopt.speculative.generate import GenerateOutput, SpeculationStats, generate
from kvopt.speculative.lookup import PromptLookup
from kvopt.speculative.restore import speculate
from kvopt.speculative.sampling import Sampler
from kvopt.speculative.self_draft import SelfSpeculation
from kvopt.speculative.spec import Proposer, parse_proposer

__all__ = [
    "DraftModel", "GenerateOutput", "PromptLookup", "Proposer", "Sampler", "SelfSpeculation", "SpeculationStats",
    "generate", "parse_proposer", "speculate",
]  # fmt: skip
