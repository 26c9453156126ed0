"""Mining and training an AutoJudge-style judge (Garipov et al., 2025) on the embedded pair.

Mining (``mine``), on GSM8K train problems: decode the target's greedy answer; find the positions
where the draft's argmax (teacher-forced on that answer) differs; at each, substitute the draft token
and let the target regenerate greedily. If the final answer is unchanged the mismatch is
*unimportant* and the swapped sequence becomes the new reference; otherwise it is *important*.
Mining continues from the next position. Features are two target last hidden states: the one that
scores the position (what verification computes for it) and the one after consuming the draft token
(which tells draft tokens apart), concatenated (2d); AutoJudge's target-only setup.

Training (``train_judge``): ``StandardScaler`` + ``LogisticRegression``, C chosen by validation
ROC-AUC over folds that hold out whole problems, refit on everything. The judge is saved with joblib
and loaded by path.

As a rule: :class:`dropmatch.rules.judge.JudgeCriterion`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .analysis import teacher_forced
from .engine import generate
from .errors import ConfigError
from .methods import Decoder, MethodConfig
from .models import ModelPair
from .provenance import note_models
from .rules.judge import Judge
from .runner import append_result, model_identity, read_results
from .stopping import StopOnText, stop_strings


@dataclass
class Mismatch:
    """One mined draft/target disagreement."""

    problem: str
    position: int  # index in the generated answer
    target_token: int
    draft_token: int
    important: bool
    features: list[float] = field(repr=False)


def _stop_index(decode: Callable[[Sequence[int]], str], ids: list[int], stop: Sequence[str]) -> int:
    """Number of leading tokens before the first stop string appears in the decoded text."""
    if not stop or not any(s in decode(ids) for s in stop):
        return len(ids)
    low, high = 0, len(ids)  # decode(ids[:high]) contains a stop string, decode(ids[:low]) does not
    while high - low > 1:
        mid = (low + high) // 2
        if any(s in decode(ids[:mid]) for s in stop):
            high = mid
        else:
            low = mid
    return low


class Miner:
    """Mines one problem at a time; see the module docstring.

    Args:
        pair: target and draft.
        answer: final answer from generated text (GSM8K: the last number after ``####``).
        stop: stop strings of the task (a bare ``str`` is one stop string).
        max_new_tokens: budget of the greedy answer and of every regeneration.
        max_mismatches: mismatches labelled per problem (bounds the cost: one regeneration each).
    """

    def __init__(self, pair: ModelPair, answer: Callable[[str], str | None], stop: str | Sequence[str] = (),
                 max_new_tokens: int = 160, max_mismatches: int = 6, draft_len: int = 5):
        if pair.draft is None:
            raise ConfigError("mining needs a draft model")
        self.pair, self.answer, self.stop = pair, answer, stop_strings(stop)
        self.max_new_tokens, self.max_mismatches = max_new_tokens, max_mismatches
        self.greedy = Decoder(pair, MethodConfig("sd", draft_len=draft_len))  # lossless: the target's greedy output

    def _continue(self, ids: list[int], budget: int) -> list[int]:
        if budget <= 0:
            return []
        should_stop = StopOnText(self.pair.decode, self.stop) if self.stop else None
        out = generate(self.pair.target, ids, drafter=self.greedy.drafter, rule=self.greedy.rule,
                       draft_len=self.greedy.config.draft_len, max_new_tokens=budget,
                       eos_token_ids=self.pair.eos_token_ids, should_stop=should_stop)
        return out.token_ids

    def _final(self, answer_ids: list[int]) -> str | None:
        return self.answer(self.pair.decode(answer_ids[: _stop_index(self.pair.decode, answer_ids, self.stop)]))

    def _teacher_forced(self, prompt: list[int], answer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft argmax (n,) and target hidden states (n, d) at the positions scoring ``answer_ids``."""
        hidden, _, draft_logits = teacher_forced(self.pair, prompt, answer_ids)
        return draft_logits.argmax(-1).cpu(), hidden.float().cpu()

    def _state_after(self, ids: list[int]) -> torch.Tensor:
        """Target last hidden state (d,) after consuming ``ids``."""
        with torch.inference_mode():
            hidden = self.pair.target.trunk(input_ids=torch.tensor([ids], device=self.pair.target.device))
        return hidden.last_hidden_state[0, -1].float().cpu()

    def mine(self, problem_id: str, prompt: list[int]) -> list[Mismatch]:
        reference = self._continue(prompt, self.max_new_tokens)
        final = self._final(reference)
        eos = set(self.pair.eos_token_ids)
        found: list[Mismatch] = []
        position = 0
        while len(found) < self.max_mismatches:
            valid = _stop_index(self.pair.decode, reference, self.stop)
            draft_argmax, hidden = self._teacher_forced(prompt, reference)
            disagree = [i for i in range(position, valid) if int(draft_argmax[i]) != reference[i]]
            if not disagree:
                break
            i = disagree[0]
            token = int(draft_argmax[i])
            swapped = reference[:i] + [token]
            if token not in eos:  # nothing follows an EOS
                swapped += self._continue(prompt + swapped, self.max_new_tokens - len(swapped))
            important = self._final(swapped) != final
            # features: the state scoring position i, and the state after consuming the draft token
            features = torch.cat([hidden[i], self._state_after(prompt + swapped[: i + 1])])
            found.append(Mismatch(problem_id, i, reference[i], token, important, features.tolist()))
            if not important:
                reference = swapped
            position = i + 1
        return found


def mining_settings(pair: ModelPair, stop: str | Sequence[str], max_new_tokens: int,
                    max_mismatches: int) -> dict:
    """What a mined record depends on besides its problem: the models, the budget, the mismatch cap."""
    return {"model": model_identity(pair), "stop": list(stop_strings(stop)), "max_new_tokens": max_new_tokens,
            "max_mismatches": max_mismatches}


def mine(pair: ModelPair, problems: Sequence[tuple[str, str]], out: str | Path, *,
         answer: Callable[[str], str | None], stop: str | Sequence[str] = (), max_new_tokens: int = 160,
         max_mismatches: int = 6, progress: bool = True) -> list[Mismatch]:
    """Mine ``problems`` (id, prompt text) into ``out`` (JSON lines, one problem per line), resumably.

    Each line carries its :func:`mining_settings`; only lines with this run's settings are reused, so
    other budgets or caps mine anew (appending to ``out``) instead of returning stale labels."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    note_models(pair)
    settings = mining_settings(pair, stop, max_new_tokens, max_mismatches)
    done = {r["problem"]: r for r in read_results(out, key="problem") if r.get("settings") == settings}
    miner = Miner(pair, answer, stop, max_new_tokens, max_mismatches)
    todo = [(pid, text) for pid, text in problems if pid not in done]
    for pid, text in tqdm(todo, desc="mining", disable=not progress, initial=len(problems) - len(todo),
                          total=len(problems)):
        mismatches = miner.mine(pid, pair.encode(text))
        record = {"problem": pid, "settings": settings, "mismatches": [asdict(m) for m in mismatches]}
        append_result(out, record)
        done[pid] = record
    return [Mismatch(**m) for pid, _ in problems for m in done[pid]["mismatches"]]


def train_judge(mismatches: Sequence[Mismatch], Cs: Sequence[float] = (0.001, 0.01, 0.1, 1.0, 10.0),
                folds: int = 4, seed: int = 0) -> Judge:
    """Fit the judge; C is chosen by :func:`validation_auc` over :func:`problem_folds` (folds that hold out
    whole problems), then the model is refit on everything."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.asarray([m.features for m in mismatches], dtype=np.float32)
    y = np.asarray([m.important for m in mismatches], dtype=int)
    problems = np.asarray([m.problem for m in mismatches])
    if int(min(np.bincount(y, minlength=2))) < 2:
        raise ConfigError(f"need at least 2 important and 2 unimportant mismatches to train, got "
                          f"{int(y.sum())} and {int(len(y) - y.sum())}; mine more problems")

    def model(c: float):
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=5000))

    splits = problem_folds(y, problems, folds, seed)  # the same folds for every C
    aucs = {c: validation_auc(model(c), x, y, splits) for c in Cs}
    best = max(Cs, key=lambda c: -1.0 if math.isnan(aucs[c]) else aucs[c])  # the smallest C on ties
    info = {"C": best, "val_auc": aucs[best], "val_auc_by_C": aucs, "n": len(y), "important": int(y.sum()),
            "problems": int(np.unique(problems).size),
            "validation": "ROC-AUC of out-of-fold P(important), folds grouped by problem",
            "features": "target hidden state scoring the position + after the draft token", "dim": int(x.shape[1])}
    return Judge(model(best).fit(x, y), info)


def problem_folds(y: np.ndarray, problems: np.ndarray, folds: int = 4,
                  seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(training, held-out) index arrays of min(``folds``, problems) folds over the mismatches with labels
    ``y`` (n,) that hold out whole problems (``problems`` (n,): the mismatches of one problem share its
    context, so a fold that split them would score the judge on problems it was trained on), stratified
    by label as far as the problems allow."""
    from sklearn.model_selection import StratifiedGroupKFold

    n_problems = int(np.unique(problems).size)
    if n_problems < 2:
        raise ConfigError(f"the judge's validation holds out whole problems, so it needs mismatches from at least "
                          f"2 problems, got {n_problems}; mine more problems")
    splitter = StratifiedGroupKFold(n_splits=min(folds, n_problems), shuffle=True, random_state=seed)
    return list(splitter.split(np.zeros((len(y), 1)), y, problems))


def validation_auc(model, x: np.ndarray, y: np.ndarray, splits: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """ROC-AUC of ``model``'s out-of-fold P(important) over the mismatches ``x`` (n, features), ``y`` (n,),
    on ``splits`` (from :func:`problem_folds`). The scores of all folds are pooled into one AUC, since a
    held-out fold may hold one class only; a fold whose training part holds one class is skipped. NaN
    when the scored mismatches hold one class."""
    from sklearn.base import clone
    from sklearn.metrics import roc_auc_score

    scores = np.full(len(y), np.nan)
    for train, held_out in splits:
        if np.unique(y[train]).size == 2:
            scores[held_out] = clone(model).fit(x[train], y[train]).predict_proba(x[held_out])[:, 1]
    scored = ~np.isnan(scores)
    if np.unique(y[scored]).size < 2:
        return math.nan
    return float(roc_auc_score(y[scored], scores[scored]))


def thresholds_for_shares(judge: Judge, mismatches: Sequence[Mismatch], shares: Sequence[float]) -> list[float]:
    """Thresholds at which the judge accepts (P(important) < t) at least each share of ``mismatches``.

    AutoJudge sets its threshold for a target recall rather than as a raw probability: a judge's
    probabilities sit near the base rate of important mismatches, so fixed cut-offs such as 0.05 can
    accept nothing. ``shares`` in [0, 1]; share 0 gives threshold 0 (exact match).
    """
    if not mismatches:
        raise ConfigError("no mined mismatches to set thresholds on; mine more problems")
    if any(not 0 <= s <= 1 for s in shares):
        raise ConfigError(f"acceptance shares must be in [0, 1], got {list(shares)}")
    p = np.sort(judge.p_important(np.asarray([m.features for m in mismatches], dtype=np.float32)))
    out = []
    for s in shares:
        n = int(np.ceil(s * len(p)))
        out.append(0.0 if n == 0 else min(1.0, float(np.nextafter(p[n - 1], np.inf))))
    return out


def mismatches_to_json(mismatches: Sequence[Mismatch]) -> str:
    return json.dumps([asdict(m) for m in mismatches])
