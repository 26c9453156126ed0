"""The one prepared device check of the DropMatch issue: ``python -m dropmatch.benchmarks.gpu_check``.

1. The CUDA path against the CPU path on the tiny random pair: greedy SD and DropMatch at p_drop = 0
   (float32 heads) must emit the same tokens on both. (At p_drop > 0 each device draws its own masks;
   ``tests/test_sparse_heads.py`` and ``tests/test_cuda.py`` check the CUDA heads' decisions and the
   CUDA decoding paths, EAGLE-3 included: ``pytest tests/test_cuda.py tests/test_sparse_heads.py``.)
2. The head overhead at Llama-3.1-8B's shape (hidden 4096, vocabulary 128,256, random bf16 weights),
   and at the embedded Gemma-3-270M's (hidden 640, vocabulary 262,144, 18 layers):
   K = 5 dropout heads plus the js+majority rule at L + 1 = 6 positions, as a percentage of one
   forward pass over 6 tokens. The forward is timed as a stack of random layers of that shape (32 for
   8B; their weight matrices applied in sequence; attention over 6 tokens is negligible) plus embedding
   lookup and head, and also estimated as the bf16 weights (~16 GB for 8B) over the memory bandwidth
   measured by a copy.
   The paper reports 1.64 % (Table 4, 70B; hardware not stated). Mask generation (on the device) is timed with
   the heads; the path (sparse dropped columns or dense GEMM) follows DropoutHead's cost rule.
   Beside it, the engine's own rule on one greedy verify step (:func:`rule_overhead`: the standard rule
   against RelaxedVerification + DropMatch, lazy and certified, one evaluated position), the cost of
   every position's decision in a few batched ops (uncertified float32: a floor for such a path), and with
   ``--profile ROWS`` the torch profiler's top ops of that step and its op and kernel-launch counts.
3. Greedy SD vs greedy AR on a few prompts (tiny pair, bfloat16 on the device): the share of prompts and
   of tokens where they differ (``sd_ar_mismatch``; near-ties in bfloat16 can make them differ).

On a CPU-only machine it runs the same code at a reduced shape (``--small``), which is what the tests do.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import run_command
from ..heads.dropout import DropoutHead
from ..models import ModelPair
from ..provenance import machine_line
from ..rules import RelaxedVerification, StandardVerification, VerifyInput
from ..rules.divergence import js_divergence
from ..rules.dropmatch import DropMatch, decide
from ..sampling import SamplingConfig, argmax
from .common import format_table


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's matrix shapes (Llama-3.1-8B by default)."""

    hidden: int = 4096
    intermediate: int = 14336
    kv_dim: int = 1024
    layers: int = 32
    vocab: int = 128_256

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.intermediate
        return bytes_per_param * (self.layers * per_layer + 2 * self.vocab * self.hidden)


SMALL = Shape(hidden=256, intermediate=512, kv_dim=64, layers=2, vocab=4096)
# the embedded target's shape (its attention's 4 x 256 query width approximated by the hidden width)
GEMMA_270M = Shape(hidden=640, intermediate=2048, kv_dim=256, layers=18, vocab=262_144)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cuda_matches_cpu(pair: ModelPair | None = None, prompt: list[int] | None = None,
                     max_new_tokens: int = 32, device: torch.device | str = "cuda") -> bool | None:
    """Whether the CUDA path emits the CPU path's tokens (float32 models and heads) for greedy SD and
    for DropMatch at p_drop = 0, which is standard verification on any device (at p_drop > 0 the masks,
    drawn on each device's own generator, differ by device); None without CUDA. ``pair`` defaults to
    the tiny random pair, loaded on the CPU and then moved to ``device``."""
    if not torch.cuda.is_available():
        return None
    from ..methods import Decoder, MethodConfig
    from ..models import load_pair

    pair = pair or load_pair("tiny", device="cpu")
    prompt = pair.encode("Speculative decoding on two devices") if prompt is None else prompt
    configs = (MethodConfig("sd"), MethodConfig("dropmatch", p_drop=0.0, head_dtype="float32"))
    cpu = [Decoder(pair, c).generate(prompt, max_new_tokens).token_ids for c in configs]
    pair.target.model.to(device)
    pair.draft.model.to(device)
    gpu = [Decoder(pair, c).generate(prompt, max_new_tokens).token_ids for c in configs]
    return gpu == cpu


MISMATCH_PROMPTS = ("Speculative decoding on two devices", "Question: 2 + 2 =", "def fib(n):",
                    "The capital of France", "Once upon a time", "1, 1, 2, 3, 5, 8,", "Translate: bonjour",
                    "SELECT * FROM")


def sd_ar_mismatch(pair: ModelPair, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                   draft_len: int = 5) -> dict[str, float]:
    """How often greedy SD differs from greedy AR on ``prompts`` (token ids): the share of prompts whose
    outputs differ, and of token positions (over the longer output of each prompt) that differ or
    exist in one output only. Zero in float32 on a CPU; bfloat16 on a GPU can break near-ties
    differently in a multi-row verify pass, and every fidelity number assumes SD = AR."""
    from ..fidelity import first_divergence
    from ..methods import Decoder, MethodConfig

    ar, sd = Decoder(pair, MethodConfig("ar")), Decoder(pair, MethodConfig("sd", draft_len=draft_len))
    prompts_differing = tokens = tokens_differing = 0
    divergences = []
    for prompt in prompts:
        a = ar.generate(list(prompt), max_new_tokens).token_ids
        b = sd.generate(list(prompt), max_new_tokens).token_ids
        n = max(len(a), len(b))
        tokens += n
        tokens_differing += sum(i >= len(a) or i >= len(b) or a[i] != b[i] for i in range(n))
        if a != b:
            prompts_differing += 1
            divergences.append(first_divergence(b, a))
    return {"prompts": len(prompts), "prompts_differing": prompts_differing,
            "prompt_mismatch_rate": prompts_differing / len(prompts) if prompts else 0.0,
            "tokens": tokens, "tokens_differing": tokens_differing,
            "token_mismatch_rate": tokens_differing / tokens if tokens else 0.0,
            "mean_first_divergence": sum(divergences) / len(divergences) if divergences else float("nan")}


def head_overhead(shape: Shape, device: torch.device, k: int = 5, p_drop: float = 0.3, positions: int = 6,
                  repeats: int = 10, seed: int = 0) -> dict[str, float]:
    """Times (ms) of the forward stack, the clean head and the K dropout heads + rule, and the overhead."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen) * size[-1] ** -0.5).to(device=device, dtype=dtype)

    layer = [rand(shape.hidden, shape.hidden), rand(shape.kv_dim, shape.hidden), rand(shape.kv_dim, shape.hidden),
             rand(shape.hidden, shape.hidden), rand(shape.intermediate, shape.hidden),
             rand(shape.intermediate, shape.hidden), rand(shape.hidden, shape.intermediate)]
    layers = [layer] + [[w.clone() for w in layer] for _ in range(shape.layers - 1)]  # distinct memory, as in a model
    embedding, head = rand(shape.vocab, shape.hidden), rand(shape.vocab, shape.hidden)
    ids = torch.randint(0, shape.vocab, (positions,), generator=gen).to(device)

    def forward() -> torch.Tensor:
        x = embedding[ids]
        for wq, wk, wv, wo, wg, wu, wd in layers:
            q, _, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
            x = x + F.linear(q + v.repeat(1, -(-shape.hidden // shape.kv_dim))[:, : shape.hidden], wo)
            x = x + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        return F.linear(x, head)

    hidden = rand(positions, shape.hidden)
    clean = F.linear(hidden, head).float()
    dropout = DropoutHead(head, k=k, p_drop=p_drop, weight_in_compute_dtype=head)
    draft_dist = torch.softmax(rand(positions, shape.vocab).float(), dim=-1)
    greedy = SamplingConfig()

    def dropmatch_step() -> None:
        masks = dropout.draw_masks(positions, gen)  # on the device, inside the timed region
        logits = dropout.logits(hidden, clean, masks)  # (positions, K, V)
        for j in range(positions):
            decide("js+majority", logits[j], int(draft_dist[j].argmax()), draft_dist[j], greedy, None)

    copy_src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_s = _timed(lambda: copy_dst.copy_(copy_src), device, repeats)
    bandwidth = 2 * copy_src.numel() / copy_s  # bytes read + written per second
    forward_s = _timed(forward, device, max(3, repeats // 3))
    head_s = _timed(lambda: F.linear(hidden, head), device, repeats)
    dm_s = _timed(dropmatch_step, device, repeats)
    estimate_s = shape.weight_bytes() / bandwidth
    return {"forward_ms": 1e3 * forward_s, "bandwidth_forward_ms": 1e3 * estimate_s, "clean_head_ms": 1e3 * head_s,
            "dropmatch_ms": 1e3 * dm_s, "bandwidth_GBps": bandwidth / 1e9,
            "overhead_vs_timed_forward_pct": 100 * dm_s / forward_s,
            "overhead_vs_bandwidth_forward_pct": 100 * dm_s / estimate_s, "sparse_path": float(dropout.sparse)}


def rule_overhead(shape: Shape, device: torch.device, criterion: str = "js+majority", k: int = 5,
                  p_drop: float = 0.3, draft_len: int = 5, logit_std: float = 4.0, repeats: int = 20,
                  seed: int = 0, profile_rows: int = 0) -> dict[str, float]:
    """The engine's verification rules on one greedy verify step at ``shape`` (random bfloat16 head,
    hidden states scaled so the clean logits have standard deviation ``logit_std``, which makes them
    peaked as a trained model's are): the draft is the target's argmax except at position 2, where it
    is the best token below the maximum, so the standard rule rejects there and DropMatch evaluates its
    criterion (lazily, masks drawn inside the step), as in a step of tau ~3. Times (ms) of the standard rule and of
    DropMatch (RelaxedVerification + DropMatch, the engine's rule), the criterion evaluations and exact
    fallbacks per step. With ``profile_rows``, prints the torch profiler's top ops of the DropMatch step
    (by device time) and returns the ops launched per step."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen) * shape.hidden ** -0.5).to(device, torch.bfloat16)
    hidden = (torch.randn(draft_len + 1, shape.hidden, generator=gen) * logit_std).to(device, torch.bfloat16)
    logits = F.linear(hidden, weight).float()
    draft = argmax(logits[:draft_len])  # the standard rule's own tie-break (bfloat16 logits do tie)
    reject_at = min(2, draft_len - 1)
    below_top = logits[reject_at].clone()
    below_top[below_top == below_top.max()] = float("-inf")
    draft[reject_at] = argmax(below_top)  # a token strictly below the maximum: the standard rule rejects it
    draft_logits = logits[:draft_len] + torch.randn(logits[:draft_len].shape, generator=gen).to(device)
    head = DropoutHead(weight, k=k, p_drop=p_drop)
    rules = {"standard": StandardVerification(), "dropmatch": RelaxedVerification(DropMatch(head, criterion))}

    def step(rule) -> object:
        inp = VerifyInput(draft, None, logits, hidden, SamplingConfig(), torch.Generator().manual_seed(seed),
                          draft_logits=draft_logits)
        return rule.verify(inp)

    def batched() -> list[bool]:
        """Every position's js+majority decision in a few whole-step ops and one host read, from the
        heads' float32 logits (bfloat16 products) with no error bounds: what a batched path would cost,
        not a certified rule."""
        masks = head.draw_masks(draft_len, torch.Generator().manual_seed(seed))
        heads = head.logits(hidden[:draft_len], logits[:draft_len], masks)  # (L, K, V)
        votes = (heads.argmax(-1) == draft.unsqueeze(-1)).sum(-1) * 2 > k
        centre = torch.softmax(heads.mean(1), -1).unsqueeze(1)  # (L, 1, V)
        radius = js_divergence(torch.softmax(heads, -1), centre).amax(-1)
        q = torch.softmax(draft_logits, -1)
        return (votes | (js_divergence(q, centre.squeeze(1)) <= radius)).tolist()

    assert step(rules["standard"]).n_accepted == reject_at, "the step must reject at the planned position"
    times = {name: _timed(lambda r=rule: step(r), device, repeats) for name, rule in rules.items()}
    times["batched"] = _timed(batched, device, repeats)
    verdict = step(rules["dropmatch"])
    counters = rules["dropmatch"].criterion.counters
    steps = repeats + 2  # the warm-up, the timed calls and the verdict above
    result = {"standard_rule_ms": 1e3 * times["standard"], "dropmatch_rule_ms": 1e3 * times["dropmatch"],
              "batched_all_positions_uncertified_ms": 1e3 * times["batched"],
              "evaluations_per_step": counters.evaluations / steps, "exact_fallbacks_per_step":
              counters.exact_fallbacks / steps, "accepted": float(verdict.n_accepted), "sparse_path": float(head.sparse)}
    if profile_rows:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                step(rules["dropmatch"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        events = prof.key_averages()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"# profile of the DropMatch rule step ({criterion}, p_drop={p_drop}), 5 steps")
        print(events.table(sort_by=sort, row_limit=profile_rows))
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)  # runtime and driver API
        top_level = [e for e in prof.events() if e.name.startswith("aten::")
                     and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        result["kernel_launches_per_step"] = launches / 5
        result["aten_ops_per_step"] = len(top_level) / 5  # ops called from Python, not the ops inside them
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a reduced shape (for CPU smoke runs)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per quantity (>= 1)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="print the torch profiler's top ROWS ops of the DropMatch rule step")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    device = torch.device(args.device)
    shapes = {"small": SMALL} if args.small else {"llama-3.1-8b": Shape(), "gemma-3-270m": GEMMA_270M}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    print(f"# DropMatch device check on {device} ({name + '; ' if name else ''}{machine_line()}); shapes {shapes}")
    same = cuda_matches_cpu(device=device) if device.type == "cuda" else None
    print(f"CUDA tokens equal CPU tokens (tiny pair, SD and DropMatch at p_drop 0, float32 heads): "
          f"{same if same is not None else 'n/a (no CUDA)' if not torch.cuda.is_available() else 'n/a (not run on CUDA)'}")
    from ..models import load_pair

    bf16 = load_pair("tiny", device=device, dtype="bfloat16")
    prompts = MISMATCH_PROMPTS[:2] if args.small else MISMATCH_PROMPTS
    mismatch = sd_ar_mismatch(bf16, [bf16.encode(p) for p in prompts], max_new_tokens=16 if args.small else 32)
    print(f"greedy SD vs AR (tiny pair, bfloat16, {device}): " + ", ".join(f"{k} {v:.4g}" for k, v in mismatch.items()))
    rows = []
    for shape_name, shape in shapes.items():
        for p_drop in (0.032, 0.3):  # the equal-noise p_drop of a 640-wide model, and the paper's default
            result = head_overhead(shape, device, p_drop=p_drop, repeats=args.repeats)
            rows += [{"quantity": f"{shape_name}: {key} (p_drop={p_drop})", "value": value}
                     for key, value in result.items()]
            rule = rule_overhead(shape, device, p_drop=p_drop, repeats=args.repeats, profile_rows=args.profile)
            rule["rule_overhead_vs_timed_forward_pct"] = 100 * (
                rule["dropmatch_rule_ms"] - rule["standard_rule_ms"]) / result["forward_ms"]
            rows += [{"quantity": f"{shape_name}: engine rule {key} (p_drop={p_drop})", "value": value}
                     for key, value in rule.items()]
    rows.append({"quantity": "paper overhead (Table 4, K=5)", "value": 1.64})
    print(format_table(rows, ["quantity", "value"]))


if __name__ == "__main__":
    sys.exit(run_command(main))
