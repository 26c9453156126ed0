"""Training an EAGLE-3 head on the target's own predictions (``python -m dropmatch draft train``).

Two phases inside one wall-clock budget, both resumable (re-running the same command continues):

1. **Data.** English training text (GSM8K train questions + solutions in the 4-shot prompt format, MMLU
   dev rows; never a test split, no Korean) is packed into sequences of ``seq_len`` tokens. The draft
   vocabulary is the ``draft_vocab`` most frequent tokens of that text. The target runs teacher-forced
   over each sequence (one prefill per sequence) and we keep, per position, the three feature layers
   (3 x d, bfloat16) and the target's top-``topk`` logits over the draft vocabulary (its next-token
   distribution restricted to the draft vocabulary, as soft labels; not the text's own tokens).
   One file per sequence under ``work_dir``.
2. **Training** with EAGLE-3's training-time test: the head is unrolled ``ttt_steps`` times on its own
   output states (step j: row p attends to step-0 rows <= p and to its own rows of steps 1..j, at rotary
   position p + j, exactly as in chain drafting); the loss is the soft cross-entropy against the target's
   distribution, step j weighted 0.8^j. Checkpoints every ``checkpoint_minutes``. The learning rate
   warms up over ``warmup_steps`` and decays (cosine, to a tenth) over ``max_steps``; without
   ``max_steps`` over a step count estimated once, from the speed of the first ``ESTIMATE_AFTER`` steps,
   and kept in ``work_dir`` for resumed runs. The schedule depends on the step count only: with
   ``max_steps`` a run is reproducible from its seed; a run the budget ends is reproducible only where
   the estimate and the number of steps come out the same (both depend on the machine's speed).

The result is written in the public EAGLE-3 layout (see :mod:`dropmatch.drafters.eagle3`) with the LM head
tied to the target's rows (not stored) and a ``manifest.json`` (data, steps, seed, revision, accuracy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from time import monotonic

import torch
import torch.nn.functional as F

from .drafters.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers, init_head, save_head
from .errors import ConfigError, DataError
from .models import CausalLM, ModelPair
from .paths import data_dir

log = logging.getLogger(__name__)

TRAIN_SOURCES = ("gsm8k_train", "mmlu_dev")  # keys of dropmatch.tasks.data.SOURCES
ESTIMATE_AFTER = 20  # steps timed to estimate a budget-bounded run's length (its learning-rate schedule)


@dataclass
class TrainConfig:
    """Everything that decides a training run (stored in the manifest)."""

    out: str
    work_dir: str
    budget_minutes: float = 40.0
    data_fraction: float = 0.3  # share of the budget the data phase may use
    seq_len: int = 256
    draft_vocab: int = 8192
    topk: int = 32
    ttt_steps: int = 3
    batch_size: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    max_steps: int | None = None
    max_sequences: int | None = None
    intermediate_size: int = 1536
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    val_sequences: int = 4
    checkpoint_minutes: float = 3.0
    seed: int = 0
    sources: tuple[str, ...] = TRAIN_SOURCES

    def __post_init__(self) -> None:
        at_least = {"seq_len": 2, "draft_vocab": 1, "topk": 1, "ttt_steps": 1, "batch_size": 1, "warmup_steps": 1,
                    "intermediate_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2,
                    "val_sequences": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.seq_len < self.ttt_steps + 1:
            raise ConfigError(f"seq-len must be >= ttt-steps + 1 (each unrolled step predicts a later token), got "
                              f"seq-len {self.seq_len} and ttt-steps {self.ttt_steps}")
        for name, low in (("max_steps", 1), ("max_sequences", 2)):  # one validation + one training sequence
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ConfigError(f"{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)!r}")
        if not (self.budget_minutes > 0 and self.lr > 0 and self.checkpoint_minutes > 0):
            raise ConfigError("budget-minutes, lr and checkpoint-minutes must be > 0")
        if not 0 < self.data_fraction < 1:
            raise ConfigError(f"data-fraction must be in (0, 1), got {self.data_fraction!r}")
        _check_sources(self.sources)


# ------------------------------------------------------------------------------------------
# Text


def _check_sources(sources: tuple[str, ...]) -> None:
    if not sources or any(s not in TRAIN_SOURCES for s in sources):
        raise ConfigError(f"training sources must be some of {', '.join(TRAIN_SOURCES)}, got {list(sources)!r}")


def training_documents(sources: tuple[str, ...] = TRAIN_SOURCES, root: Path | None = None) -> list[str]:
    """English training documents: GSM8K train (``Question: ...\\nAnswer: ...``, the few-shot prompt
    format) and MMLU dev rows by subject (question, lettered choices, answer). Training splits only, read
    and checked by the benchmark loader (a malformed file, or a missing one the hub cannot replace, is a
    ``DataError``)."""
    from .tasks.data import _choices, _records

    _check_sources(sources)
    root = root or data_dir()
    docs: list[str] = []
    if "gsm8k_train" in sources:
        docs += [f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in _records("gsm8k_train", root)]
    if "mmlu_dev" in sources:
        dev = _records("mmlu_dev", root)
        for subject in sorted(dev):
            for r in dev[subject]:
                choices = "".join(f"{letter}. {text}\n" for letter, text in zip("ABCD", _choices(r), strict=True))
                docs.append(f"{r['question']}\n{choices}Answer: {'ABCD'[int(r['answer'])]}\n\n")
    return docs


def pack_sequences(token_docs: list[list[int]], seq_len: int, bos: int | None, seed: int) -> list[list[int]]:
    """Shuffle documents (seeded) and pack them into sequences of ``seq_len`` tokens, each starting with BOS."""
    order = list(range(len(token_docs)))
    random.Random(seed).shuffle(order)
    body = seq_len - (bos is not None)
    sequences, current = [], []
    for i in order:
        current.extend(token_docs[i])
        while len(current) >= body:
            sequences.append(([bos] if bos is not None else []) + current[:body])
            current = current[body:]
    return sequences


def draft_vocabulary(token_docs: list[list[int]], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties by id), plus ``always`` (e.g. EOS); sorted (N,)."""
    counts = Counter(t for doc in token_docs for t in doc)
    chosen = list(dict.fromkeys(list(always) + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


# ------------------------------------------------------------------------------------------
# Data phase


def target_labels(target: CausalLM, ids: torch.Tensor, layers: tuple[int, ...], vocab: torch.Tensor, topk: int):
    """Teacher-forced target pass over ``ids`` (T,): features (T, 3d) bf16, top-k draft ids (T, k) int32
    and their target logits (T, k) float16 (the target's logits restricted to the draft vocabulary)."""
    with torch.inference_mode():
        out = target.trunk(input_ids=ids.view(1, -1).to(target.device), output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).to(torch.bfloat16).cpu()
        rows = target.head_weight[vocab.to(target.device)]
        logits = out.last_hidden_state[0] @ rows.T
        if target.softcap:
            logits = torch.tanh(logits / target.softcap) * target.softcap
        values, index = logits.float().topk(min(topk, logits.shape[-1]), dim=-1)
    return features, index.to(torch.int32).cpu(), values.to(torch.float16).cpu()


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _load_state(work: Path) -> dict:
    path = work / "progress.json"
    return json.loads(path.read_text()) if path.exists() else {"elapsed_s": 0.0}


def _save_state(work: Path, state: dict) -> None:
    tmp = work / "progress.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(work / "progress.json")


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def _head_shape(config_json: dict) -> dict:
    """The head shape a ``config.json`` text describes, however :meth:`Eagle3Config.to_dict` spelled it."""
    shape = asdict(Eagle3Config.from_dict(config_json))
    del shape["extra"]
    return shape


def _check_resumable(work: Path, state: dict, run: dict) -> None:
    """Record what the work directory's labels and checkpoint depend on (the sequences, the draft
    vocabulary the label ids index, the head's shape, the settings its steps were taken with), or refuse
    to resume a run that differs. A setting an older record lacks is taken as it is now."""
    run = json.loads(json.dumps(run))
    saved = state["run"] = {**run, **state.get("run", {})}
    changed = [k for k in run if k != "head" and saved[k] != run[k]]
    if _head_shape(saved["head"]) != _head_shape(run["head"]):
        changed.append("head shape")
    if changed:
        raise ConfigError(f"{work} holds a training run with other {', '.join(changed)}; resume with its "
                          "settings, or pass a new --work-dir")
    _save_state(work, state)


def learning_rate(cfg: TrainConfig, step: int, total_steps: int | None) -> float:
    """The learning rate of step ``step`` (0-based): linear warmup over ``warmup_steps``, then a cosine
    decay to a tenth at ``total_steps`` (none while the run's length is not known yet)."""
    progress = min(step / total_steps, 1.0) if total_steps else 0.0
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------
# Training-time test


class TTTAttention:
    """Attention of EAGLE-3's training-time test. Step 0 is causal over its own rows; a query of step j
    sees step-0 keys at rows <= its row and, of steps 1..j, only its own row (the keys of the draft's
    own deeper positions)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        self.keys.append(k)
        self.values.append(v)
        scale = 1 / math.sqrt(q.shape[-1])
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = [(q @ self.keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [((q * key).sum(-1, keepdim=True) * scale) for key in self.keys[1:]]
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        ctx = weights[..., :t] @ self.values[0]
        for j, value in enumerate(self.values[1:], start=1):
            ctx = ctx + weights[..., t + j - 1 : t + j] * value
        return ctx


def ttt_loss(head: Eagle3Head, embed, features: torch.Tensor, tokens: torch.Tensor, label_ids: torch.Tensor,
             label_logits: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float], list[int]]:
    """Training-time-test loss on a batch.

    Args:
        features: (B, T, 3d) target features; row p = position p.
        tokens: (B, T) token ids; label_ids / label_logits: (B, T, k) top-k draft ids and target logits
            at each position (the target's prediction of the token after it).
        steps: unrolled draft steps.
    Returns: weighted loss, per-step top-1 accuracy (draft argmax == target top-1 in the draft
    vocabulary), per-step row counts.
    """
    b, t, _ = features.shape
    attend = TTTAttention()
    positions = torch.arange(t, device=features.device).expand(b, t)
    hidden = features
    total = features.new_zeros((), dtype=torch.float32)
    accs, counts = [], []
    for j in range(steps):
        valid = t - 1 - j  # row p needs the token and the label at position p + 1 + j
        if valid <= 0:
            break
        tok = F.pad(tokens[:, 1 + j :], (0, 1 + j))
        with torch.no_grad():  # the target's embedding is frozen: no (V, d) gradient
            emb = embed(tok)
        hidden = head.state(emb, hidden, positions + j, attend)
        logp = torch.log_softmax(head.logits(hidden[:, :valid]), dim=-1)
        ids = label_ids[:, 1 + j : 1 + j + valid].long()
        p = torch.softmax(label_logits[:, 1 + j : 1 + j + valid].float(), dim=-1)
        loss = -(p * logp.gather(-1, ids)).sum(-1).mean()
        total = total + 0.8**j * loss
        accs.append(float((logp.argmax(-1) == ids[..., 0]).float().mean()))
        counts.append(b * valid)
    return total, accs, counts


# ------------------------------------------------------------------------------------------
# Driver


def head_config(target: CausalLM, cfg: TrainConfig) -> Eagle3Config:
    tc = target.model.config
    layers = default_feature_layers(int(tc.num_hidden_layers))
    d = int(target.head_weight.shape[1])
    return Eagle3Config(hidden_size=d, intermediate_size=cfg.intermediate_size,
                        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, vocab_size=target.vocab_size, draft_vocab_size=cfg.draft_vocab,
                        target_hidden_size=d, rms_norm_eps=1e-6,
                        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)),
                        feature_layers=layers, tie_lm_head_to_target=True)


def train_draft(pair: ModelPair, cfg: TrainConfig, documents: list[str] | None = None) -> dict:
    """Run (or resume) both phases within ``cfg.budget_minutes`` of accumulated wall time; write the head
    to ``cfg.out``. Returns the manifest."""
    from tqdm import tqdm

    from .provenance import git_revision

    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    state = _load_state(work)
    budget = cfg.budget_minutes * 60
    session_start = monotonic()
    elapsed0 = state["elapsed_s"]

    def elapsed() -> float:
        return elapsed0 + monotonic() - session_start

    target = pair.target
    docs = documents if documents is not None else training_documents(cfg.sources)
    token_docs = [pair.tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    bos = getattr(pair.tokenizer, "bos_token_id", None)
    sequences = pack_sequences(token_docs, cfg.seq_len, bos, cfg.seed)
    if cfg.max_sequences:
        sequences = sequences[: cfg.max_sequences]
    if len(sequences) < 2:  # one to validate on, one to train on
        raise DataError(f"need >= 2 sequences of {cfg.seq_len} tokens, got {len(sequences)} from {len(docs)} "
                        "documents; give more text or a smaller --seq-len")
    eos = tuple(i for i in pair.eos_token_ids if i < target.vocab_size)
    vocab = draft_vocabulary(token_docs, cfg.draft_vocab, always=eos)
    config = head_config(target, cfg)
    config.draft_vocab_size = int(vocab.numel())
    layers = config.feature_layers
    _check_resumable(work, state, {"sequences": _digest(sequences), "draft_vocabulary": _digest(vocab.tolist()),
                                   "topk": cfg.topk, "head": config.to_dict(), "ttt_steps": cfg.ttt_steps,
                                   "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup_steps": cfg.warmup_steps})
    in_vocab = set(vocab.tolist())
    covered = sum(t in in_vocab for doc in token_docs for t in doc) / max(1, sum(map(len, token_docs)))
    log.info("%d documents, %d sequences of %d tokens; draft vocabulary %d covers %.1f%% of text tokens",
             len(docs), len(sequences), cfg.seq_len, vocab.numel(), 100 * covered)

    # Phase 1: target labels, one file per sequence
    data_budget = budget * cfg.data_fraction
    done = sorted(int(p.stem.split("_")[1]) for p in work.glob("seq_*.pt"))
    n_done = len(done)
    with tqdm(total=len(sequences), initial=n_done, desc="target labels", unit="seq") as bar:
        for i in range(n_done, len(sequences)):
            if elapsed() >= data_budget and n_done >= cfg.val_sequences + 1:
                break
            feats, ids, values = target_labels(target, torch.tensor(sequences[i]), layers, vocab, cfg.topk)
            _atomic_save({"tokens": torch.tensor(sequences[i], dtype=torch.int32), "features": feats,
                          "label_ids": ids, "label_logits": values}, work / f"seq_{i:05d}.pt")
            n_done += 1
            bar.update(1)
            state["elapsed_s"] = elapsed()
            _save_state(work, state)
    shards = [torch.load(work / f"seq_{i:05d}.pt") for i in range(n_done)]
    n_val = state.setdefault("n_val", min(cfg.val_sequences, max(1, len(shards) // 10)))  # fixed once set
    train_shards, val_shards = shards[n_val:], shards[:n_val]

    # Phase 2: training
    embed = target.model.get_input_embeddings()
    ckpt = work / "train_state.pt"
    head = init_head(config, target, vocab, seed=cfg.seed).float()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history = 0, []
    if not ckpt.exists():
        calibrate_norm(head, embed, [s for s in train_shards[: cfg.batch_size]], cfg.ttt_steps)
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
        step, history = saved["step"], saved["history"]
        log.info("resuming training at step %d", step)
    margin = min(30.0, 0.05 * budget)  # kept for the export
    total_steps = cfg.max_steps or state.get("estimated_steps")

    def batch():
        pick = torch.randint(len(train_shards), (cfg.batch_size,), generator=gen).tolist()
        return [torch.stack([train_shards[i][k] for i in pick]) for k in ("features", "tokens", "label_ids",
                                                                        "label_logits")]

    def save_checkpoint():
        _atomic_save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "generator": gen.get_state(),
                      "step": step, "history": history}, ckpt)
        state["elapsed_s"] = elapsed()
        _save_state(work, state)

    last_ckpt = timed_from = monotonic()
    first_step = step
    head.train()
    with tqdm(total=cfg.max_steps, initial=step, desc="train eagle3", unit="step") as bar:
        while (cfg.max_steps is None or step < cfg.max_steps) and elapsed() < budget - margin:
            lr = learning_rate(cfg, step, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            feats, tokens, label_ids, label_logits = batch()
            loss, accs, _ = ttt_loss(head, embed, feats.float(), tokens.long(), label_ids, label_logits, cfg.ttt_steps)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if total_steps is None and step - first_step == ESTIMATE_AFTER:  # once per run, kept for resuming
                seconds_per_step = (monotonic() - timed_from) / ESTIMATE_AFTER
                left = max(0, int((budget - margin - elapsed()) / seconds_per_step))
                total_steps = state["estimated_steps"] = step + left
                log.info("learning-rate schedule over an estimated %d steps", total_steps)
            history.append({"step": step, "loss": loss.item(), "acc": accs, "lr": lr, "t": elapsed()})
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs),
                            left=f"{(budget - elapsed()) / 60:.1f}m")
            if monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
                save_checkpoint()
                last_ckpt = monotonic()
    save_checkpoint()
    if step == 0:
        raise ConfigError(f"the budget of {cfg.budget_minutes:g} minutes left no time for a training step "
                          f"({elapsed():.0f} s used); nothing written to {cfg.out}. Re-run with a larger "
                          f"--budget-minutes to continue the run in {work}")
    head.eval()
    val = evaluate(head, embed, val_shards, cfg.ttt_steps)
    manifest = {
        "data": {"sources": list(cfg.sources), "documents": len(docs), "sequences_used": n_done,
                 "train_tokens": sum(int(s["tokens"].numel()) for s in train_shards),
                 "val_sequences": n_val, "labels": f"target top-{cfg.topk} logits over the draft vocabulary",
                 "draft_vocab_text_coverage": covered},
        "steps": step, "lr_schedule_steps": total_steps, "seed": cfg.seed, "code_revision": git_revision(),
        "elapsed_minutes": elapsed() / 60, "train_config": asdict(cfg),
        "val_top1_acc_per_ttt_step": val,
        "final_train_loss": history[-1]["loss"],
    }
    save_head(head, cfg.out, manifest=manifest)
    state["elapsed_s"] = elapsed()
    _save_state(work, state)
    log.info("EAGLE-3 head in %s after %d steps; validation top-1 per step %s", cfg.out, step, val)
    return manifest


def calibrate_norm(head: Eagle3Head, embed, shards: list[dict], steps: int,
                   scales: tuple[float, ...] = (1.0, 0.3, 0.1, 0.03, 0.01)) -> float:
    """Scale the initial final-norm weight (the logit scale of the tied LM head) to the value with the
    lowest loss on ``shards``: the logit-lens start can be confidently wrong. Returns the scale."""
    base = head.norm.weight.detach().clone()
    losses = []
    with torch.no_grad():
        for scale in scales:
            head.norm.weight.copy_(base * scale)
            losses.append(sum(float(ttt_loss(head, embed, s["features"][None].float(), s["tokens"][None].long(),
                                             s["label_ids"][None], s["label_logits"][None], steps)[0])
                              for s in shards))
        best = scales[min(range(len(scales)), key=losses.__getitem__)]
        head.norm.weight.copy_(base * best)
    log.info("initial logit scale %g (losses %s)", best, ", ".join(f"{x:.2f}" for x in losses))
    return best


def evaluate(head: Eagle3Head, embed, shards: list[dict], steps: int) -> list[float | None]:
    """Top-1 agreement with the target (within the draft vocabulary) per unrolled step on ``shards``
    (``None`` for a step without rows)."""
    sums, counts = [0.0] * steps, [0] * steps
    with torch.no_grad():
        for s in shards:
            _, accs, ns = ttt_loss(head, embed, s["features"][None].float(), s["tokens"][None].long(),
                                   s["label_ids"][None], s["label_logits"][None], steps)
            for j, (a, n) in enumerate(zip(accs, ns, strict=True)):
                sums[j] += a * n
                counts[j] += n
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]
