"""The one prepared device check of the DropMatch issue: ``python -m dropmatch.benchmarks.gpu_check``.

1. The CUDA path against the CPU path on the tiny random pair: DropMatch (float32 heads) must emit the
   same tokens on both.
2. The head overhead at Llama-3.1-8B's shape (hidden 4096, vocabulary 128,256, random bf16 weights):
   K = 5 dropout heads plus the js+majority rule at L + 1 = 6 positions, as a percentage of one 8B
   forward pass over 6 tokens. The forward is timed as a stack of 32 random layers of that shape (their
   weight matrices applied in sequence; attention over 6 tokens is negligible) plus embedding lookup and
   head, and also estimated as the ~16 GB of bf16 weights over the memory bandwidth measured by a copy.
   The paper reports 1.64 % (Table 4, 70B on A100s). Mask generation (on the device) is timed with
   the heads; the path (sparse dropped columns or dense GEMM) follows DropoutHead's cost rule.
3. Greedy SD vs greedy AR on a few prompts (tiny pair, bfloat16 on the device): the share of prompts and
   of tokens where they differ (``sd_ar_mismatch``; near-ties in bfloat16 can make them differ).

On a CPU-only machine it runs the same code at a reduced shape (``--small``), which is what the tests do.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..heads.dropout import DropoutHead
from ..models import ModelPair
from ..rules.dropmatch import decide
from ..sampling import SamplingConfig
from .common import format_table, machine_line


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
                     max_new_tokens: int = 32) -> bool | None:
    """Whether DropMatch gives the same tokens on CUDA as on CPU for ``pair`` (default: the tiny
    random pair, loaded on the CPU; it is moved to CUDA); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from ..methods import Decoder, MethodConfig
    from ..models import load_pair

    pair = pair or load_pair("tiny", device="cpu")
    prompt = prompt or pair.encode("Speculative decoding on two devices")
    config = MethodConfig("dropmatch", head_dtype="float32")
    cpu = Decoder(pair, config).generate(prompt, max_new_tokens).token_ids
    pair.target.model.cuda()
    pair.draft.model.cuda()
    gpu = Decoder(pair, config).generate(prompt, max_new_tokens).token_ids
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
            x = x + F.linear(q + v.repeat(1, shape.hidden // shape.kv_dim), wo)
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
            "overhead_vs_bandwidth_forward_pct": 100 * dm_s / estimate_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a reduced shape (for CPU smoke runs)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = SMALL if args.small else Shape()
    print(f"# DropMatch device check on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}"
          f"{machine_line()}); shape {shape}")
    same = cuda_matches_cpu()
    print(f"CUDA tokens equal CPU tokens (tiny pair, DropMatch, float32 heads): "
          f"{'n/a (no CUDA)' if same is None else same}")
    from ..models import load_pair

    bf16 = load_pair("tiny", device=device, dtype="bfloat16")
    prompts = MISMATCH_PROMPTS[:2] if args.small else MISMATCH_PROMPTS
    mismatch = sd_ar_mismatch(bf16, [bf16.encode(p) for p in prompts], max_new_tokens=16 if args.small else 32)
    print(f"greedy SD vs AR (tiny pair, bfloat16, {device}): " + ", ".join(f"{k} {v:.4g}" for k, v in mismatch.items()))
    rows = []
    for p_drop in (0.032, 0.3):  # the equal-noise p_drop of a 640-wide model, and the paper's default
        result = head_overhead(shape, device, p_drop=p_drop, repeats=args.repeats)
        rows += [{"quantity": f"{key} (p_drop={p_drop})", "value": value} for key, value in result.items()]
    rows.append({"quantity": "paper overhead (Table 4, K=5)", "value": 1.64})
    print(format_table(rows, ["quantity", "value"]))


if __name__ == "__main__":
    main()
