"""Engine benchmark: our AR and SD against Hugging Face ``generate`` on the embedded pair.

    python -m dropmatch.benchmarks.engine [--prompts 4] [--max-new-tokens 96] [--draft-len 5] [--repeats 2]

All rows are measured in one process, interleaved prompt by prompt (each round of rows starting one row later
than the last, so that no row always follows the same one), on 4-shot GSM8K prompts with greedy decoding,
after one warm-up generation per method. Tokens/s is total new tokens over total
wall time (prefill included) per method, beside the mean over generations and the decode tokens/s
after the prefill (Hugging Face rows: minus the time of a one-token ``generate`` on the same prompt);
tau is ours (per target forward, prefill included), paper tau per verify step. Speedups are ratios
against rows of the same run, end to end and (``decode vs HF plain``) after the prefill; those against our
AR carry a 95 % paired bootstrap interval over the generations (prompt x pass; it shows how far prompts
and timing noise move the ratio, not the drift of the machine between runs). The draft model
and the EAGLE-3 head run twice each: at the fixed draft length L (the paper's setting, whose tau the issue
reports) and with proposals that end after a draft token below ``--draft-stop`` (a dynamic draft length,
like HF's assistant confidence threshold; lossless, the stop depends on the draft alone). Lookup-first
rows (``--lookup-first``: n-gram lookup where the context's last bigram or trigram occurred before, the
EAGLE-3 head elsewhere) run at ``--lookup-len``, beside the same lookup alone at that length, so the head's
share of the gain shows; the guided row lets the head pick between lookup matches (``--lookup-guide``, see
:class:`~dropmatch.drafters.LookupFirstDrafter`).

Our rows start from the prompts' shared 4-shot exemplars cached once, outside the clocks
(:mod:`~dropmatch.prompt_cache`; as a server with a prefix cache would; the int8 draft model's from its own
cached prefix), and prefill only each question;
Hugging Face's rows prefill the whole prompt. Our AR and the guided lookup-first row also run with the
whole prompt prefilled (``cold prefill``): each row is compared with our AR in the same prefill setting
(Hugging Face's rows with the cold one; their own ratios to cached rows compare unlike prefills). Outputs are
checked against HF plain's greedy output, except our SD rows from the cached exemplars, which are checked
against our AR from them (a split prefill may move a near-tie; our cached AR is itself checked against HF
plain). ``--no-prefix-cache`` runs every row cold; with a single prompt nothing is shared and every row is
cold.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..drafters import LookupFirstDrafter, ModelDrafter, NgramDrafter
from ..drafters.eagle3 import Eagle3Drafter, committed_head, drafting_dtype, load_head
from ..drafters.lookup_first import check_lookup_guide
from ..engine import generate
from ..errors import run_command
from ..models import load_pair
from ..prompt_cache import PromptPrefix, shared_prefix
from ..provenance import describe_model, machine_line
from .common import SPEED_COLUMNS, SpeedTotals, format_table, gsm8k_fewshot_prompts


def _hf_runner(pair, **kwargs):
    model = pair.target.model

    def run(ids: list[int], max_new: int) -> tuple[list[int], float]:
        inputs = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new,
                                 do_sample=False, **kwargs)
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    return run


COLD = " (cold prefill)"  # the name suffix of our rows that prefill the whole prompt


def _our_runner(pair, drafter_factory, draft_len, prefix: PromptPrefix | None = None):
    def run(ids: list[int], max_new: int) -> tuple[list[int], float, float]:
        drafter = drafter_factory() if drafter_factory else None
        result = generate(pair.target, ids, drafter=drafter, draft_len=draft_len, max_new_tokens=max_new,
                          eos_token_ids=pair.eos_token_ids, prefix=prefix)
        return result.token_ids, result.stats.wall_s, result.stats.target_calls, result.stats.prefill_s

    return run


def _is_cached(name: str, cached: bool) -> bool:
    """Whether row ``name`` starts from the cached exemplars (``cached``: the bench caches them)."""
    return cached and name.startswith("ours") and not name.endswith(COLD)


def _ar_row(name: str, cached: bool) -> str:
    """The AR row ``name`` is compared with: our AR in the same prefill setting (Hugging Face's: the cold one)."""
    return "ours AR" if _is_cached(name, cached) or not cached else "ours AR" + COLD


def _interval(totals: SpeedTotals, ours_ar: SpeedTotals | None, decode: bool) -> str:
    """``[lo, hi]`` of ``totals``' speedup over our AR (empty without an AR row, or for the AR row)."""
    if ours_ar is None or totals is ours_ar:
        return ""
    lo, hi = totals.speedup_over(ours_ar, decode=decode)
    return f"[{lo:.2f}, {hi:.2f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (interleaved)")
    parser.add_argument("--draft-stop", type=float, default=0.4,
                        help="the rows with a dynamic draft length (draft model, EAGLE-3) stop after a draft token "
                             "below this")
    parser.add_argument("--lookup-len", type=int, default=8,
                        help="draft length of the lookup-first and matching n-gram rows (lookup drafts cost nothing "
                             "to propose, so longer copied spans pay)")
    parser.add_argument("--lookup-guide", type=float, default=0.5,
                        help="the guided lookup-first row: the EAGLE-3 head's own draft replaces a disagreeing lookup "
                             "where its first token's untempered draft probability is at least this")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="our rows prefill the whole prompt too (default: the shared exemplars are cached once)")
    parser.add_argument("--only", nargs="+", help="rows whose name contains one of these (HF plain is always run)")
    args = parser.parse_args(argv)
    check_lookup_guide(args.lookup_guide)

    pair = load_pair("gemma-3-270m")
    pair.target.prepare()  # the screened head: built before any clock starts
    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    shared = shared_prefix(prompts)
    cached = args.prefix_cache and len(shared) > 0
    head_dir = committed_head(pair.name)
    eagle3 = load_head(head_dir, pair.target, dtype=drafting_dtype(pair.target)) if head_dir is not None else None
    # one prefix serves every row: the EAGLE-3 head's feature layers recorded, the others ignore them
    layers = Eagle3Drafter(eagle3, pair.target).feature_layers if eagle3 is not None else ()
    prefix = pair.target.cache_prefix(shared, layers) if cached else None
    draft_prefix = pair.draft.cache_prefix(shared) if cached else None  # the int8 draft's own
    L = args.draft_len
    kind = describe_model(pair.draft).split(" on ")[0]  # e.g. "int8 dynamic", read off the loaded draft
    hf_assist = dict(assistant_model=pair.draft.model, num_assistant_tokens=L,
                     num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    model_stop_row = f"ours SD ({kind} draft, L<={L}, stop below p={args.draft_stop:g})"  # dynamic draft length
    methods = {
        "HF generate (plain)": _hf_runner(pair),
        f"HF assisted ({kind} draft, L={L})": _hf_runner(pair, **hf_assist),
        f"HF prompt lookup (L={L})": _hf_runner(pair, prompt_lookup_num_tokens=L),
        "ours AR": _our_runner(pair, None, L, prefix),
        f"ours SD ({kind} draft, L={L})": _our_runner(pair, lambda: ModelDrafter(pair.draft, prefix=draft_prefix), L, prefix),
        model_stop_row: _our_runner(pair, lambda: ModelDrafter(pair.draft, args.draft_stop, draft_prefix), L,
                                  prefix),
        f"ours SD (n-gram, L={L})": _our_runner(pair, NgramDrafter, L, prefix),
    }
    if cached:
        methods["ours AR" + COLD] = _our_runner(pair, None, L)
    eagle3_row = f"ours SD (EAGLE-3, L={L})"
    eagle3_stop_row = f"ours SD (EAGLE-3, L<={L}, stop below p={args.draft_stop:g})"  # dynamic draft length
    if eagle3 is not None:  # the committed EAGLE-3 head (make train-draft)
        methods[eagle3_row] = _our_runner(pair, lambda: Eagle3Drafter(eagle3, pair.target), L, prefix)
        methods[eagle3_stop_row] = _our_runner(pair, lambda: Eagle3Drafter(eagle3, pair.target, args.draft_stop), L,
                                               prefix)
        lookup_len = args.lookup_len
        methods[f"ours SD (n-gram, bigram or longer, L={lookup_len})"] = _our_runner(
            pair, lambda: NgramDrafter(min_ngram=2), lookup_len, prefix)
        methods[f"ours SD (lookup-first + EAGLE-3, L<={lookup_len}, stop below p={args.draft_stop:g})"] = _our_runner(
            pair, lambda: LookupFirstDrafter(Eagle3Drafter(eagle3, pair.target, args.draft_stop)), lookup_len, prefix)
        guided_row = (f"ours SD (lookup-first + EAGLE-3 guided at p={args.lookup_guide:g}, L<={lookup_len}, stop "
                      f"below p={args.draft_stop:g})")

        def guided() -> LookupFirstDrafter:
            return LookupFirstDrafter(Eagle3Drafter(eagle3, pair.target, args.draft_stop), guide_at=args.lookup_guide)

        methods[guided_row] = _our_runner(pair, guided, lookup_len, prefix)
        if cached:
            methods[guided_row + COLD] = _our_runner(pair, guided, lookup_len)
    if args.only:  # HF plain and the AR row each kept row is compared with always run
        selected = [k for k in methods if any(s in k for s in args.only)]
        keep = {"HF generate (plain)", *selected, *(_ar_row(k, cached) for k in selected)}
        methods = {k: v for k, v in methods.items() if k in keep}
    for run in methods.values():  # warm-up: a whole prompt, so cached rows prefill a question's rows as timed
        run(prompts[0], 8)
    totals = {name: SpeedTotals() for name in methods}
    hf_prefill = _hf_runner(pair)
    names = list(methods)
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            prefill_s = hf_prefill(ids, 1)[1]  # HF rows: the prefill is a one-token generate's time
            shift = (repeat * len(prompts) + i) % len(names)  # each round starts one row later: no fixed neighbours
            outputs = {}
            for name in names[shift:] + names[:shift]:
                out = methods[name](ids, args.max_new_tokens)
                outputs[name] = out[0]
                totals[name].add(len(out[0]), out[1], out[3] if len(out) > 3 else prefill_s,
                                 out[2] if len(out) > 2 else 0)
            for name, tokens in outputs.items():
                # SD from the cached exemplars against AR from them (a split prefill may move a near-tie);
                # every other row, our cached AR included, against HF plain's greedy output
                sd_cached = _is_cached(name, cached) and name != "ours AR" and "ours AR" in outputs
                totals[name].identical &= tokens == outputs["ours AR" if sd_cached else "HF generate (plain)"]
    plain = totals["HF generate (plain)"].row()
    assisted_t = totals.get(f"HF assisted ({kind} draft, L={L})")
    assisted = assisted_t.row() if assisted_t else None
    rows = []
    for name, t in totals.items():
        speeds = t.row()
        ar_totals = totals.get(_ar_row(name, cached))
        ours_ar = ar_totals.row() if ar_totals else None
        rows.append({"method": name, **speeds, "vs HF plain": speeds["tokens/s"] / plain["tokens/s"],
                     "vs HF assisted": speeds["tokens/s"] / assisted["tokens/s"] if assisted else "",
                     "vs ours AR": speeds["tokens/s"] / ours_ar["tokens/s"] if ours_ar else "",
                     "vs ours AR 95% CI": _interval(t, ar_totals, decode=False),
                     "decode vs HF plain": speeds["decode tokens/s"] / plain["decode tokens/s"],
                     "decode vs ours AR": speeds["decode tokens/s"] / ours_ar["decode tokens/s"] if ours_ar else "",
                     "decode vs ours AR 95% CI": _interval(t, ar_totals, decode=True),
                     "identical to greedy": "yes" if t.identical else "NO"})
    settings = (f"our rows start from the {prefix.ids.numel()}-token shared exemplars, cached (cold prefill and "
                "Hugging Face's rows: the whole prompt); vs ours AR: the AR row of the same setting; our cached SD "
                "rows are checked against our cached AR, which is checked against HF plain"
                if cached else "every row prefills the whole prompt")
    print(f"# engine benchmark: {len(prompts)} 4-shot GSM8K prompts x {args.repeats}, "
          f"{args.max_new_tokens} new tokens, greedy; {settings}; {machine_line()}")
    print(format_table(rows, ["method", *SPEED_COLUMNS, "vs HF plain", "vs HF assisted", "vs ours AR",
                              "vs ours AR 95% CI", "decode vs HF plain", "decode vs ours AR",
                              "decode vs ours AR 95% CI", "identical to greedy"]))
    for name, t in totals.items():
        if name.startswith("ours SD") and not t.identical:
            raise SystemExit(f"{name}: output differs from greedy decoding")


if __name__ == "__main__":
    sys.exit(run_command(main))
