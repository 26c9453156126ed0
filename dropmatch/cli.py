"""Command line: ``python -m dropmatch generate ...`` (more subcommands register themselves here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from .errors import ConfigError, DropMatchError, run_command
from .fidelity import compare_to_greedy, summarize_fidelity
from .methods import METHODS, Decoder, MethodConfig
from .models import GEMMA_PAIR, PAIRS, load_pair
from .sampling import SamplingConfig

log = logging.getLogger("dropmatch")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--pair", default=GEMMA_PAIR, help=f"named pair: {', '.join(PAIRS)} (default {GEMMA_PAIR})")
    group.add_argument("--target", help="target model: Hugging Face id or local directory (instead of --pair)")
    group.add_argument("--draft", help="'ngram' for prompt lookup, 'eagle3' for an EAGLE-3 head (see --draft-head), "
                       "else a draft model id or directory (with --target)")
    group.add_argument("--draft-head", help="with --draft eagle3: an EAGLE-3 head directory or hub id (default: the "
                       "committed head of the embedded pair)")
    group.add_argument("--draft-stop", type=float, help="with a draft model or --draft eagle3: end a proposal after a "
                       "draft token of probability below this (a dynamic draft length; default: always --draft-len tokens)")
    group.add_argument("--dtype", help="float32, bfloat16 or float16 for hub models")
    group.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA when present)")
    group.add_argument("--device-map", help="'auto': spread a hub target over the GPUs present (e.g. a 70B), the "
                       "draft on the head's GPU (default: $DROPMATCH_DEVICE_MAP, else one device)")


def add_method_args(parser: argparse.ArgumentParser) -> None:
    d = MethodConfig()
    group = parser.add_argument_group("method")
    group.add_argument("--method", default="sd", choices=METHODS)
    group.add_argument("--draft-len", type=int, default=d.draft_len, help="draft tokens per step, L")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0)
    dm = parser.add_argument_group("DropMatch (--method dropmatch)")
    dm.add_argument("--k", type=int, default=d.k, help="number of dropout heads K")
    dm.add_argument("--p-drop", type=float, default=d.p_drop, help="dropout probability on the head input")
    dm.add_argument("--criterion", default=d.criterion, help="naive, js, majority or js+majority")
    dm.add_argument("--majority", default=d.majority, help="strict (> K/2) or plurality")
    dm.add_argument("--literal", action="store_true",
                    help="paper-literal: the criterion decides every position, exact matches included")
    dm.add_argument("--head-dtype", help="dtype of the dropout heads' GEMM (default bfloat16; on a CPU float32 head, "
                                         "greedy steps certify exact decisions on 8-bit sparse corrections on x86 "
                                         "(one int8 GEMM over the head where K p_drop >= 0.5 and oneDNN runs it) "
                                         "and on bfloat16 rows for naive / majority votes where bfloat16 is native, "
                                         "sampled steps compute exact float32 heads; float32 asks for exact heads "
                                         "throughout; a warning says when the dtype does not apply)")
    rv = parser.add_argument_group("rivals (--method topk|typical|divergence|fly|ensemble)")
    rv.add_argument("--topk", type=int, default=d.topk, help="top-K acceptance: K")
    rv.add_argument("--typical-eps", type=float, default=d.typical_eps)
    rv.add_argument("--typical-delta", type=float, default=d.typical_delta)
    rv.add_argument("--divergence", default=d.divergence, help="js or kl")
    rv.add_argument("--divergence-threshold", type=float, default=d.divergence_threshold)
    rv.add_argument("--fly-entropy", type=float, default=d.fly_entropy,
                    help="FLy: keep a mismatch only where the target's top-3 entropy is >= this (nats)")
    rv.add_argument("--fly-window", type=int, default=d.fly_window,
                    help="FLy: following draft tokens that must be accepted exactly (the authors' win_len - 1; "
                         "needs --draft-len >= this + 2)")
    rv.add_argument("--ensemble-weight", type=float, default=d.ensemble_weight,
                    help="static ensemble: verify against w p + (1 - w) q; 1 = standard verification")
    jg = parser.add_argument_group("trained judge (--method judge|judge+dropmatch)")
    jg.add_argument("--judge", dest="judge_path", help="judge file from `python -m dropmatch judge train`")
    jg.add_argument("--judge-threshold", type=float, default=d.judge_threshold,
                    help="accept when P(important) is below this")
    parser.add_argument("--ngram-max", type=int, default=d.ngram_max,
                        help="longest n-gram for --draft ngram and --lookup-first")
    parser.add_argument("--lookup-first", action="store_true",
                        help="with a draft model or --draft eagle3: propose what followed the context's last n-gram "
                             "where it occurred before (prompt lookup), the draft only where none did")
    parser.add_argument("--lookup-min", type=int, default=d.lookup_min,
                        help="with --lookup-first: the shortest n-gram that counts as a match")
    parser.add_argument("--lookup-guide", type=float, metavar="P",
                        help="with --draft eagle3 --lookup-first: the head's first token picks among the lookup "
                             "matches, and its own draft replaces a disagreeing lookup where that token's untempered "
                             "draft probability is at least P (e.g. 0.5)")


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The decoding's sampling settings; ``--top-p`` without a temperature is refused (greedy decoding
    takes the argmax, so it would change nothing)."""
    if args.temperature == 0 and args.top_p < 1:
        raise ConfigError("--top-p filters sampled tokens: pass --temperature > 0 with it (temperature 0 is greedy)")
    return SamplingConfig(args.temperature, args.top_p)


def method_config(args: argparse.Namespace) -> MethodConfig:
    if getattr(args, "draft_head", None) and args.draft != "eagle3":
        raise ConfigError("--draft-head names an EAGLE-3 head: pass it with --draft eagle3")
    return MethodConfig(
        method=args.method, draft=args.draft if args.draft in ("ngram", "eagle3") else "model",
        draft_head=getattr(args, "draft_head", None), draft_stop=getattr(args, "draft_stop", None),
        draft_len=args.draft_len,
        k=args.k, p_drop=args.p_drop, criterion=args.criterion, majority=args.majority, literal=args.literal,
        head_dtype=args.head_dtype, topk=args.topk, typical_eps=args.typical_eps,
        typical_delta=args.typical_delta, divergence=args.divergence,
        divergence_threshold=args.divergence_threshold, ngram_max=args.ngram_max,
        lookup_first=args.lookup_first, lookup_min=args.lookup_min,
        lookup_guide=args.lookup_guide,
        fly_entropy=args.fly_entropy, fly_window=args.fly_window, ensemble_weight=args.ensemble_weight,
        judge_path=args.judge_path, judge_threshold=args.judge_threshold,
    )


def pair_from_args(args: argparse.Namespace, config: MethodConfig):
    draft_model = None if args.draft in (None, "ngram", "eagle3") else args.draft
    need_draft = config.speculative and config.draft == "model"
    if args.target:
        if need_draft and draft_model is None:
            raise DropMatchError("--target needs --draft ID (a draft model) or --draft ngram for this method")
        return load_pair(None, target=args.target, draft=draft_model, dtype=args.dtype, device=args.device,
                         need_draft=need_draft, device_map=getattr(args, "device_map", None))
    if draft_model is not None:
        raise DropMatchError("--draft ID needs --target ID; with --pair only --draft ngram is accepted")
    return load_pair(args.pair, dtype=args.dtype, device=args.device, need_draft=need_draft,
                     device_map=getattr(args, "device_map", None))


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_file is None):
        raise DropMatchError("pass exactly one of --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt if args.prompt is not None else read_text_file(args.prompt_file, "prompt")
    config = method_config(args)
    sampling = sampling_config(args)
    decoder = Decoder(pair_from_args(args, config), config, sampling)
    result = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, seed=args.seed)
    text = decoder.pair.decode(result.token_ids)
    payload = {"text": text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}
    if args.fidelity:
        payload["fidelity"] = fidelity_of(decoder, [prompt], [result.token_ids], args.max_new_tokens)[0].to_dict()
    if args.json:
        print(json.dumps(payload))
    else:
        print(text)
        s = result.stats
        log.info("%s: %d tokens, tau %.2f, %.2f tokens/s", config.label, s.new_tokens, s.tau, s.tokens_per_s)
        if args.fidelity:
            log.info("fidelity to the target's greedy output: %s", payload["fidelity"])
    return 0


def fidelity_of(decoder: Decoder, prompts: list[str], outputs: list[list[int]], max_new_tokens: int):
    """Compare outputs with the target's greedy output, decoded autoregressively (as the runner's
    reference: greedy SD may break a near-tie otherwise in bfloat16 on GPUs, and `--method sd` was then
    compared with itself)."""
    from .runner import GreedyReference

    reference = GreedyReference(decoder.pair, (), max_new_tokens)
    results = []
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = decoder.pair.encode(prompt)
        greedy = reference.lookup(ids)
        results.append(compare_to_greedy(decoder.pair.target, ids, output, greedy["token_ids"], greedy["nll"]))
    return results


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of a user-given file, or a ConfigError saying why it cannot be read."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no {what} file at {path}" + (" (it is a directory)" if file.is_dir() else ""))
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per line) or a JSON-lines file (a string field ``prompt`` per line)."""
    lines = [(n, line) for n, line in enumerate(read_text_file(path, "prompts").splitlines(), 1) if line.strip()]
    if not lines:
        raise ConfigError(f"prompts file {path} holds no prompts")
    if not path.endswith(".jsonl"):
        return [line.replace("\\n", "\n") for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{n}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f"{path}:{n}: each line must be a JSON object with a string field 'prompt'")
        prompts.append(record["prompt"])
    return prompts


def cmd_fidelity(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)  # before the models load: a bad file fails at once
    config = method_config(args)
    decoder = Decoder(pair_from_args(args, config), config, sampling_config(args))
    outputs = [decoder.generate(p, max_new_tokens=args.max_new_tokens, seed=args.seed).token_ids for p in prompts]
    items = fidelity_of(decoder, prompts, outputs, args.max_new_tokens)
    print(json.dumps({"method": config.label, **summarize_fidelity(items), "per_prompt": [f.to_dict() for f in items]}))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .runner import run_task
    from .tasks.llm_judge import JudgeEndpoint, load_judge_prompts

    config = method_config(args)
    judge = JudgeEndpoint.from_env(args.judge_url, args.judge_model)
    if judge is not None:  # before the models load: a wrong task, URL or key fails at once
        load_judge_prompts(args.task, args.data_dir)
        judge.check()
    decoder = Decoder(pair_from_args(args, config), config, sampling_config(args))
    records = run_task(decoder, args.task, args.out, limit=args.limit, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, fidelity=args.fidelity,
                       chat_template=args.chat_template, data_dir=args.data_dir, llm_judge=judge,
                       prefix_cache=args.prefix_cache)
    log.info("%d results in %s", len(records), args.out)
    return 0


def cmd_summarize(args: argparse.Namespace) -> int:
    from .benchmarks.common import format_table
    from .summarize import COLUMNS, summarize_files

    rows = summarize_files(args.files, baseline=args.baseline)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    return 0


def cmd_judge_mine(args: argparse.Namespace) -> int:
    from .judge_mining import mine
    from .tasks import generation_defaults, load_gsm8k_train
    from .tasks.metrics import extract_gsm8k_answer

    args.method, args.draft_len = "sd", 5
    pair = pair_from_args(args, MethodConfig("sd"))
    problems = [(e.id, e.prompt) for e in load_gsm8k_train(limit=args.problems, data_dir=args.data_dir)]
    mined = mine(pair, problems, args.out, answer=extract_gsm8k_answer, stop=generation_defaults("gsm8k").stop,
                 max_new_tokens=args.max_new_tokens, max_mismatches=args.max_mismatches)
    log.info("%d mismatches (%d important) from %d problems in %s", len(mined), sum(m.important for m in mined),
             len(problems), args.out)
    return 0


def cmd_judge_train(args: argparse.Namespace) -> int:
    from .judge_mining import Mismatch, train_judge
    from .runner import read_results

    fields = {f.name for f in dataclasses.fields(Mismatch)}
    mismatches = []
    for path in args.mined:
        if not Path(path).is_file():
            raise ConfigError(f"no mined file at {path}; mine one with `python -m dropmatch judge mine`")
        for record in read_results(Path(path), repair=False, key="problem"):
            found = record.get("mismatches")
            if not isinstance(found, list) or not all(isinstance(m, dict) and set(m) == fields for m in found):
                raise ConfigError(f"{path}: problem {record['problem']!r} has no list of mismatches with the "
                                  f"fields {sorted(fields)}; mine one with `python -m dropmatch judge mine`")
            mismatches += [Mismatch(**m) for m in found]
    judge = train_judge(mismatches, seed=args.seed)
    judge.save(args.out)
    print(json.dumps(judge.info))
    return 0


def cmd_draft_train(args: argparse.Namespace) -> int:
    from .draft_training import TrainConfig, train_draft
    from .paths import cache_root

    out = args.out or str(Path(__file__).resolve().parent / "assets" / f"eagle3-{args.pair}")
    cfg = TrainConfig(out=out, work_dir=args.work_dir or str(cache_root() / f"eagle3-train-{args.pair}-s{args.seed}"),
                      budget_minutes=args.budget_minutes, data_fraction=args.data_fraction, seq_len=args.seq_len,
                      draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, batch_size=args.batch_size,
                      lr=args.lr, max_steps=args.max_steps, max_sequences=args.max_sequences, seed=args.seed)
    manifest = train_draft(load_pair(args.pair, need_draft=False), cfg)  # settings checked before the model loads
    print(json.dumps({"out": out, "steps": manifest["steps"], "val_top1_acc_per_ttt_step":
                      manifest["val_top1_acc_per_ttt_step"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dropmatch", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode one prompt")
    add_model_args(gen)
    add_method_args(gen)
    gen.add_argument("--prompt")
    gen.add_argument("--prompt-file")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    gen.add_argument("--fidelity", action="store_true",
                     help="also compare with the target's greedy output (exact match, first divergence, NLL)")
    gen.set_defaults(func=cmd_generate)
    fid = sub.add_parser("fidelity", help="fidelity of a method to the target's greedy output on a prompt set")
    add_model_args(fid)
    add_method_args(fid)
    fid.add_argument("--prompts", required=True,
                     help="text file (one prompt per line, \\n for newlines) or .jsonl with a 'prompt' field")
    fid.add_argument("--max-new-tokens", type=int, default=64)
    fid.set_defaults(func=cmd_fidelity)
    run = sub.add_parser("run", help="decode a benchmark into a JSON-lines file (resumable)")
    add_model_args(run)
    add_method_args(run)
    run.add_argument("--task", required=True, help="gsm8k, mmlu, humaneval, ifeval, mt_bench, komt_bench, klue_nli, kullm")
    run.add_argument("--out", required=True, help="results file (JSON lines); an existing one is resumed")
    run.add_argument("--limit", type=int, help="first N examples")
    run.add_argument("--max-new-tokens", type=int, help="default: the task's own")
    run.add_argument("--fidelity", action="store_true", help="also record fidelity to the target's greedy output")
    run.add_argument("--chat-template", action="store_true", help="use the tokenizer's chat template (chat tasks)")
    run.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="prefill every prompt whole (default: the task's shared few-shot beginning is prefilled once)")
    run.add_argument("--data-dir", help="benchmark data directory (default: $DROPMATCH_DATA or ../shared/data)")
    run.add_argument("--judge-url", help="OpenAI-compatible endpoint that grades MT-bench answers "
                     "(default $DROPMATCH_JUDGE_URL; none: no LLM judge)")
    run.add_argument("--judge-model", help="judge model name (default $DROPMATCH_JUDGE_MODEL)")
    run.set_defaults(func=cmd_run)
    summ = sub.add_parser("summarize", help="one table over result files")
    summ.add_argument("files", nargs="+")
    summ.add_argument("--baseline", default="sd", help="method label (or prefix) the speedup is relative to")
    summ.add_argument("--json", action="store_true")
    summ.set_defaults(func=cmd_summarize)
    judge = sub.add_parser("judge", help="the trained-judge baseline: mine labels, train")
    judge_sub = judge.add_subparsers(dest="judge_command", required=True)
    mine_p = judge_sub.add_parser("mine", help="label draft/target mismatches on GSM8K train (resumable)")
    add_model_args(mine_p)
    mine_p.add_argument("--problems", type=int, default=24, help="number of GSM8K train problems")
    mine_p.add_argument("--max-mismatches", type=int, default=6, help="labelled mismatches per problem")
    mine_p.add_argument("--max-new-tokens", type=int, default=160)
    mine_p.add_argument("--data-dir")
    mine_p.add_argument("--out", required=True, help="JSON lines, one problem per line")
    mine_p.set_defaults(func=cmd_judge_mine)
    train_p = judge_sub.add_parser("train", help="fit scaler + logistic regression, C by validation ROC-AUC")
    train_p.add_argument("--mined", nargs="+", required=True)
    train_p.add_argument("--out", required=True, help="judge file (joblib)")
    train_p.add_argument("--seed", type=int, default=0)
    train_p.set_defaults(func=cmd_judge_train)
    draft = sub.add_parser("draft", help="EAGLE-3 draft heads: train one on the target's own predictions")
    draft_sub = draft.add_subparsers(dest="draft_command", required=True)
    dt = draft_sub.add_parser("train", help="target labels + training-time-test training, one wall-clock budget "
                              "(resumable: re-run the same command to continue)")
    dt.add_argument("--pair", default=GEMMA_PAIR, help=f"named pair whose target the head drafts for (default {GEMMA_PAIR})")
    dt.add_argument("--out", help="head directory (default: dropmatch/assets/eagle3-PAIR)")
    dt.add_argument("--work-dir", help="features, labels and checkpoints (default: $DROPMATCH_CACHE/eagle3-train-PAIR-sSEED)")
    dt.add_argument("--budget-minutes", type=float, default=40.0, help="wall-clock budget of data + training")
    dt.add_argument("--data-fraction", type=float, default=0.3, help="share of the budget for target labels")
    dt.add_argument("--seq-len", type=int, default=256)
    dt.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most frequent tokens)")
    dt.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth")
    dt.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    dt.add_argument("--lr", type=float, default=1e-3)
    dt.add_argument("--max-steps", type=int, help="stop after this many steps (default: the budget decides)")
    dt.add_argument("--max-sequences", type=int, help="use at most this many training sequences")
    dt.add_argument("--seed", type=int, default=0)
    dt.set_defaults(func=cmd_draft_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    return run_command(args.func, args)
