"""The decoding loop: plain autoregressive decoding, or chain speculative decoding with any
drafter and any verification rule. Batch size 1, KV caches on both models.

One speculative step (draft length L):
  1. the drafter proposes up to L tokens after the newest emitted token;
  2. the target runs its trunk once over [newest, d_1..d_L] and its head on those L + 1 rows;
  3. the rule keeps a prefix of the draft and names the next token;
  4. both KV caches drop what was not kept.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .drafters import Draft, Drafter, FeatureDrafter
from .errors import ConfigError, PromptTooLongError, VocabularyMismatchError
from .models import CausalLM, rollback
from .prompt_cache import PromptPrefix
from .rules import (
    Prefetching,
    StandardVerification,
    Verdict,
    VerificationRule,
    VerifyInput,
    exact_match_prefix,
    exact_match_when_greedy,
    screened_logits_ok,
)
from .sampling import SamplingConfig, choose_token
from .stats import GenerationStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (a CUDA device is synchronized first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def verify_step(target: CausalLM, rule: VerificationRule, hidden: torch.Tensor, draft: Draft,
                sampling: SamplingConfig, generator: torch.Generator) -> Verdict:
    """The head and the rule of one verify step, on the trunk's hidden states (L + 1, d): the rule's
    prefetched rows (if any) ride in the head GEMM, then the rule decides."""
    wants = isinstance(rule, Prefetching) and draft.tokens.numel()
    prefetch = rule.prefetch(hidden, sampling, generator) if wants else None
    exact = not (sampling.greedy and screened_logits_ok(rule))
    logits, products = target.head_with_extra(hidden, prefetch.rows if prefetch else None, exact=exact)
    check_draft(draft, logits.shape[0] - 1, logits.shape[-1])
    if prefetch is not None:
        prefetch.products = products
    return rule.verify(VerifyInput(draft.tokens, draft.probs, logits, hidden, sampling, generator, draft.logits,
                                   prefetch, logits_screened=target.screens(hidden.shape[0], exact)))


def cut_draft(target: CausalLM, hidden: torch.Tensor, draft: Draft, seen: torch.Tensor) -> tuple[torch.Tensor, Draft]:
    """``(hidden, draft)`` cut to the draft's first k tokens and the rows ``0..k`` of ``hidden`` (L + 1, d),
    where k is the first position at which a token of ``seen`` (m,) or of the draft certainly outscores the
    draft token (:func:`~dropmatch.rules.standard.exact_match_prefix`); unchanged where none does.

    Under greedy exact matching the verdict is the same (row k's argmax is the correction either way), and
    the head, which costs more per row where its GEMM is compute-bound (a CPU), runs on fewer rows: on the
    embedded pair lookup drafts of 8 tokens keep ~2.4, and the context holds the target's argmax at nearly
    every rejection. A draft with token ids outside the vocabulary is left for :func:`check_draft`."""
    tokens = draft.tokens
    n = tokens.numel()
    if n == 0 or not _within(tokens, target.vocab_size):
        return hidden, draft
    candidates = torch.unique(torch.cat([seen[seen < target.vocab_size], tokens]))  # sorted, distinct
    logits, bounds = target.token_logits(hidden[:n], candidates)
    k = exact_match_prefix(tokens, candidates, logits, bounds)
    if k == n:
        return hidden, draft
    probs, draft_logits = (None if rows is None else rows[:k] for rows in (draft.probs, draft.logits))
    return hidden[: k + 1], Draft(tokens[:k], probs, draft_logits)


def _within(tokens: torch.Tensor, vocab: int) -> bool:
    """Whether the (non-empty) token ids all lie in [0, ``vocab``): one reduction (one sync on a GPU)."""
    low, high = torch.aminmax(tokens)
    return 0 <= int(low) <= int(high) < vocab


def check_draft(draft: Draft, n_draft: int, vocab: int) -> None:
    """``VocabularyMismatchError`` unless ``draft`` holds ``n_draft`` token ids in [0, ``vocab``) and its
    distributions, if any, are (n_draft, vocab): a custom drafter over another vocabulary would otherwise
    be verified silently against the wrong tokens (or fail deep inside a rule)."""
    tokens = draft.tokens
    if tokens.dim() != 1 or tokens.numel() != n_draft:
        raise VocabularyMismatchError(f"the draft has {tuple(tokens.shape)} tokens for a verify step of {n_draft}")
    if n_draft and not _within(tokens, vocab):
        raise VocabularyMismatchError(f"draft token ids {tokens.tolist()} lie outside the target's vocabulary "
                                      f"of {vocab}")
    for name in ("probs", "logits"):
        rows = getattr(draft, name)
        if rows is not None and tuple(rows.shape) != (n_draft, vocab):
            raise VocabularyMismatchError(f"draft {name} have shape {tuple(rows.shape)}; the verify step needs "
                                          f"({n_draft}, {vocab}): one row per draft token over the target's vocabulary")


def _cut_output(output: list[int], keep: int, stats: GenerationStats, last_target: bool) -> None:
    """Drop the output past ``keep`` (possibly into earlier steps) and take the dropped tokens out of the
    counts, newest first. Verify step i emitted ``stats.accepted_per_step[i]`` draft tokens and then one
    target token (the last step only if ``last_target``: an EOS among its draft tokens ends it); the
    prefill and plain-decoding steps emitted one target token each. Steps keep their target calls and
    draft counts (that work was done), so ``new_tokens == sum(accepted_per_step) + target_tokens`` holds."""
    excess = len(output) - max(keep, 0)
    target = last_target
    for i in reversed(range(len(stats.accepted_per_step))):
        if excess <= 0:
            break
        if target:
            stats.target_tokens -= 1
            excess -= 1
        dropped = min(excess, stats.accepted_per_step[i])
        stats.accepted_per_step[i] -= dropped
        excess -= dropped
        target = True
    if excess > 0:  # the prefill token (and, without a drafter, plain-decoding steps)
        stats.target_tokens -= excess
    del output[max(keep, 0) :]


def prompt_tensor(target: CausalLM, prompt_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The prompt as a (T,) int64 tensor on the target's device; ``ConfigError`` for anything that is not
    one sequence of token ids within the target's vocabulary."""
    if torch.is_tensor(prompt_ids):
        ids = prompt_ids
    else:
        listed = list(prompt_ids)
        ids = torch.as_tensor(listed) if listed else torch.zeros(0, dtype=torch.long)
    if (ids.dim() > 1 and ids.shape[0] != 1) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ConfigError(f"the prompt must be one sequence of integer token ids, got {ids.dtype} of shape "
                          f"{tuple(ids.shape)} (batches are not supported: decode one prompt at a time)")
    ids = ids.reshape(-1).to(torch.long)
    vocab = target.model.get_input_embeddings().num_embeddings
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ConfigError(f"prompt token ids must be in [0, {vocab}), got ids from {int(ids.min())} to {int(ids.max())}")
    return ids.to(target.device)


def check_lengths(target: CausalLM, n_prompt: int, max_new_tokens: int, draft_len: int) -> None:
    for name, value in (("max_new_tokens", max_new_tokens), ("draft length", draft_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if n_prompt < 1:
        raise ConfigError("the prompt is empty: pass at least one token (e.g. the BOS token)")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if draft_len < 1:
        raise ConfigError(f"draft length must be >= 1, got {draft_len}")
    if n_prompt + max_new_tokens > target.max_positions:
        raise PromptTooLongError(
            f"prompt of {n_prompt} tokens + {max_new_tokens} new tokens exceeds the model's context of "
            f"{target.max_positions} tokens; shorten the prompt or lower --max-new-tokens"
        )


def generate(
    target: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    drafter: Drafter | None = None,
    rule: VerificationRule | None = None,
    draft_len: int = 5,
    max_new_tokens: int = 64,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
    should_stop: Callable[[list[int]], int | None] | None = None,
    cut_drafts: bool = True,
    prefix: PromptPrefix | None = None,
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``.

    Without a drafter this is autoregressive decoding. With one, speculative decoding verified by
    ``rule`` (default: greedy exact match / speculative sampling). Stops after an EOS token, which
    is included in the output; nothing is emitted past it. ``should_stop(output_ids)`` is asked after
    every step (e.g. for stop strings, :class:`~dropmatch.stopping.StopOnText`): a length means "stop,
    and keep that many tokens", so a speculative step that overshoots a stop string is cut back to
    exactly what plain decoding would have emitted (statistics included). With ``cut_drafts``, greedy
    exact-match verification runs the head only up to the first draft position that a token of the
    context certainly outscores (:func:`cut_draft`; where :attr:`CausalLM.bounds_token_logits`): the
    same tokens, fewer head rows (``stats.head_rows_per_step``). A ``prefix``
    (:meth:`CausalLM.cache_prefix <dropmatch.models.CausalLM.cache_prefix>`, e.g. a benchmark's shared
    few-shot exemplars) serves the leading prompt positions it shares, which are then not prefilled
    (``stats.cached_prompt_tokens``).
    """
    sampling = sampling or SamplingConfig()
    rule = rule or StandardVerification()
    prompt = prompt_tensor(target, prompt_ids)
    check_lengths(target, prompt.numel(), max_new_tokens, draft_len)
    eos = {int(eos_token_ids)} if isinstance(eos_token_ids, int) else set(int(i) for i in eos_token_ids)
    stats = GenerationStats()
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    with torch.inference_mode():
        start = clock(device)
        layers = drafter.feature_layers if isinstance(drafter, FeatureDrafter) else ()
        # features: the target's chosen-layer states, for drafters that read them (EAGLE-3); else None
        cache, hidden, features = target.new_cache_with_features(prompt, layers, rollback=drafter is not None,
                                                                 prefix=prefix)
        stats.cached_prompt_tokens = prompt.numel() - hidden.shape[0]  # the positions the trunk did not run
        token = choose_token(target.head(hidden[-1:], exact=not sampling.greedy)[0], sampling, generator)
        output = [token]
        stats.target_calls = stats.target_tokens = 1
        stats.prefill_s = clock(device) - start
        if drafter is not None:
            drafter.start(prompt, features)
            stats.draft_s += clock(device) - start - stats.prefill_s
        keep = should_stop(output) if should_stop else None
        cuts = (cut_drafts and drafter is not None and sampling.greedy and exact_match_when_greedy(rule)
                and target.bounds_token_logits)
        seen = torch.unique(torch.cat([prompt, prompt.new_tensor(output)])) if cuts else None  # context ids
        last = (0, True)  # (accepted draft tokens, target token emitted) of the latest step
        while token not in eos and len(output) < max_new_tokens and keep is None:
            remaining = max_new_tokens - len(output)
            if drafter is None:
                token = choose_token(target.logits(prompt.new_tensor([token]), cache, exact=not sampling.greedy), sampling,
                                     generator)
                output.append(token)
                stats.target_calls += 1
                stats.target_tokens += 1
                keep = should_stop(output) if should_stop else None
                continue
            t0 = clock(device)
            draft = drafter.propose(token, min(draft_len, remaining - 1), sampling, generator)
            t1 = clock(device)
            n = int(draft.tokens.numel())
            verify_ids = torch.cat([prompt.new_tensor([token]), draft.tokens])
            hidden, features = target.hidden_and_features(verify_ids, cache, layers)
            cut_hidden, cut = cut_draft(target, hidden, draft, seen) if cuts else (hidden, draft)
            verdict = verify_step(target, rule, cut_hidden, cut, sampling, generator)
            rollback(cache, n - verdict.n_accepted)
            drafter.commit(verdict.n_accepted, None if features is None else features[: verdict.n_accepted + 1])
            t2 = clock(device)
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.target_calls += 1
            stats.drafted_per_step.append(n)
            stats.head_rows_per_step.append(cut_hidden.shape[0])
            stats.extra_accepts += verdict.extra_accepts
            stats.criterion_evaluations += verdict.criterion_evaluations
            accepted = 0
            for t in draft.tokens[: verdict.n_accepted].tolist():
                output.append(t)
                accepted += 1
                if t in eos:
                    break
            stats.accepted_per_step.append(accepted)
            token = output[-1]
            last = (accepted, token not in eos)
            if last[1]:
                token = verdict.next_token
                output.append(token)
                stats.target_tokens += 1
            if cuts:
                seen = torch.unique(torch.cat([seen, prompt.new_tensor(output[len(output) - accepted - last[1]:])]))
            keep = should_stop(output) if should_stop else None
        if keep is not None and keep < len(output):
            _cut_output(output, keep, stats, last[1])
        stats.wall_s = clock(device) - start
    stats.new_tokens = len(output)
    return GenerationResult(output, stats)
