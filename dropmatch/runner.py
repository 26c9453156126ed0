"""Run a decoding method over a benchmark and write one JSON line per example, resumably.

    python -m dropmatch run --task gsm8k --method dropmatch --k 5 --p-drop 0.3 --limit 20 --out results/x.jsonl

Each line holds the example id, the output, its task score, the generation statistics, the seed and
the configuration (and, with ``--fidelity``, the comparison with the target's greedy output). Lines
are flushed and fsynced one by one; on start the file is read back, a torn last line (the process was
killed mid-write) is cut off, and examples already done are skipped, so an interrupted run, even by
kill -9, resumes without losing or duplicating an example. ``<out>.env.json`` records the
environment of the first run.

A results file holds one configuration: a run of another one on the same ``--out`` is refused.
With ``keyed=True`` the file is :func:`keyed_path` instead, whose name carries
a hash of everything that changes a record (method configuration, model, seed, budget, fidelity,
LLM judge, the trained judge file's bytes, the prompt prefix), so changing a parameter starts a new file and the
same parameters resume the old one.

A task whose prompts share a long beginning (GSM8K's and KLUE-NLI's few-shot exemplars) has it prefilled once
per model (:func:`task_prefix`, ``prefix_cache=True``, the default; shared by every method's run and the reference,
:func:`~dropmatch.methods.shared_prompt_prefix`): each prompt copies those positions' states
(:mod:`~dropmatch.prompt_cache`) and prefills only its own question, for the target, a draft model and the
fidelity reference alike, and the NLLs read the same cached states. The states are those of a whole-prompt
prefill, computed in other GEMM calls, so a near-tie may break the other way than without the cache; records
name the prefix (``prompt_prefix``: its length and a hash of its ids), and runs with and without it never mix.

One run at a time writes a results file: for the whole run it holds an exclusive ``flock`` on
``<out>.lock`` (which names the holder's pid), so a second run started on the same ``--out`` while
the first is still going stops at once with a ``ConfigError`` naming that pid. The kernel drops the
lock when the run ends or its process dies (kill -9 included), so a later run resumes as above.
Readers (``read_results(path, repair=False)``, the summaries) take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from .errors import ConfigError
from .fidelity import compare_to_greedy, target_nll
from .methods import Decoder, MethodConfig
from .paths import data_dir as default_data_dir
from .prompt_cache import PromptPrefix, shared_prefix
from .provenance import environment_record, note_models
from .sampling import SamplingConfig
from .stats import GenerationStats
from .tasks import Example, chat_prompt, cut_output, generation_defaults, load_task, score
from .tasks.llm_judge import JudgeEndpoint, judge_example, load_judge_prompts, load_reference_answers


def read_results(path: Path, repair: bool = True, key: str | None = None) -> list[dict]:
    """Records in ``path`` (JSON objects, one per line, each with ``key`` if given). A torn last line (a writer killed
    mid-line: the start of a record, no newline) is skipped and, with ``repair`` (the writer resuming),
    cut off the file. Any other line that is not a record is an error, so a file that is not a results
    file is never truncated or appended to."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    records, good_end = [], 0
    for n, line in enumerate(lines):
        if not line.endswith(b"\n") and n == len(lines) - 1 and line.startswith(b'{"'):
            break  # torn write
        try:
            record = json.loads(line)
        except ValueError:  # malformed JSON or not UTF-8
            record = None
        if not isinstance(record, dict) or (key is not None and key not in record):
            raise ConfigError(f"{path}: line {n + 1} is not a results record; not touching the file "
                              "(pass another --out, or repair it by hand)")
        records.append(record)
        good_end += len(line)
    if repair and good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
    return records


def lock_path(out: str | Path) -> Path:
    """The sidecar file whose ``flock`` a writer of ``out`` holds."""
    out = Path(out)
    return out.with_name(out.name + ".lock")


@contextlib.contextmanager
def results_lock(out: str | Path) -> Iterator[Path]:
    """Hold the exclusive writer's lock on ``out`` (an ``flock`` on ``<out>.lock``, holding this pid)
    while the block runs; raise ``ConfigError`` at once, naming the holder's pid, if another process
    holds it. The kernel releases it when the process dies, so a killed run never leaves it stuck."""
    path = lock_path(out)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"{out} is being written by another run (pid {_lock_holder(fd)}, lock {path}); "
                "wait for it to end or use another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # while still held: a pid in the file always names the holder
    finally:
        os.close(fd)  # releases the flock


def _lock_holder(fd: int, wait_s: float = 1.0) -> str:
    """The pid written in a held lock file (its holder writes it just after locking)."""
    deadline = time.monotonic() + wait_s
    while True:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if pid or time.monotonic() > deadline:
            return pid or "unknown"
        time.sleep(0.02)


def append_result(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def merge_stats(parts: Sequence[GenerationStats]) -> GenerationStats:
    """One statistics object for several generations (the turns of a chat example)."""
    total = GenerationStats(generations=0)
    for s in parts:
        for name in ("new_tokens", "target_calls", "target_tokens", "extra_accepts", "criterion_evaluations",
                     "generations", "cached_prompt_tokens"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for name in ("prefill_s", "draft_s", "verify_s", "wall_s"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        total.accepted_per_step += s.accepted_per_step
        total.drafted_per_step += s.drafted_per_step
        total.head_rows_per_step += s.head_rows_per_step
    return total


def model_identity(pair) -> str:
    """What a result depends on besides the method: the pair's name and the target's dtype."""
    return f"{pair.name}|{pair.target.head_weight.dtype}"


class GreedyReference:
    """The target's greedy output for a prompt, optionally cached in a JSON-lines file shared by every
    run that compares against it.

    Decoded autoregressively, not by greedy SD: in bfloat16 on a GPU a multi-row verify pass can break
    a near-tie differently from a one-row step, so SD is not guaranteed to equal AR there, and every
    fidelity number is measured against this reference. The cache makes AR's extra cost a one-off.
    """

    METHOD = "ar"

    def __init__(self, pair, stop: Sequence[str], max_new_tokens: int, cache: str | Path | None = None,
                 prefix: Sequence[int] | None = None):
        self.decoder = Decoder(pair, MethodConfig(self.METHOD), SamplingConfig())
        self.stop, self.max_new_tokens = tuple(stop), max_new_tokens
        self.prefix = list(prefix) if prefix else None  # decoded from the same cached prefix as the runs it serves
        self.identity = model_identity(pair)
        note_models(pair)
        self.cache = Path(cache) if cache else None
        self._known = {r["key"]: r for r in read_results(self.cache, key="key")} if self.cache else {}

    def key(self, prompt_ids: Sequence[int]) -> str:
        # the decoding method is in the key: references an older version built with SD are not reused
        text = f"{self.identity}|{self.METHOD}|{self.max_new_tokens}|{self.stop}|{list(prompt_ids)}"
        if self.prefix:  # a reference decoded from a cached prefix is another record (keys without one unchanged)
            text += f"|prefix {prefix_name(self.prefix)}"
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    @property
    def target_prefix(self) -> PromptPrefix | None:
        """The target's cached prefix the reference decodes from (``None`` without one): the NLLs read it too."""
        return self.decoder.prompt_prefix(self.prefix) if self.prefix else None

    def __call__(self, prompt: str | Sequence[int]) -> list[int]:
        return self.lookup(prompt)["token_ids"]

    def lookup(self, prompt: str | Sequence[int]) -> dict:
        """``{"token_ids": greedy output, "nll": its target NLL per token}`` after ``prompt`` (text or ids)."""
        ids_in = self.decoder.pair.encode(prompt) if isinstance(prompt, str) else list(prompt)
        key = self.key(ids_in)
        if key not in self._known:
            ids = self.decoder.generate(ids_in, max_new_tokens=self.max_new_tokens, stop=self.stop,
                                        prefix=self.prefix).token_ids
            record = {"key": key, "token_ids": ids,
                      "nll": target_nll(self.decoder.pair.target, ids_in, ids, self.target_prefix)}
            self._known[key] = record
            if self.cache:
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                append_result(self.cache, record)
        return self._known[key]


class TaskRunner:
    """Decodes the examples of a task with one method; with ``fidelity``, compares every turn with
    the target's greedy output on the same prompt (``reference_cache``: share those across runs);
    ``llm_judge`` grades with the judge prompts and GPT-4 reference answers of ``data_dir`` (default:
    :func:`~dropmatch.paths.data_dir`); with ``prefix_cache``, the task's shared prompt beginning
    (:func:`task_prefix`) is prefilled once (``prefix``: its ids, ``None`` where the task has none)."""

    def __init__(self, decoder: Decoder, task: str, *, max_new_tokens: int | None = None, seed: int = 0,
                 fidelity: bool = False, chat_template: bool = False, reference_cache: str | Path | None = None,
                 llm_judge: JudgeEndpoint | None = None, example_seed: Callable[[int, str], int] | None = None,
                 data_dir: str | Path | None = None, prefix_cache: bool = True):
        self.decoder, self.task, self.seed = decoder, task, seed
        self.example_seed = example_seed
        self.llm_judge = llm_judge
        self.judge_prompts = load_judge_prompts(task, data_dir) if llm_judge is not None else None
        self.judge_references = load_reference_answers(task, data_dir) if llm_judge is not None else None
        defaults = generation_defaults(task)
        self.stop = defaults.stop
        self.max_new_tokens = new_token_budget(task, max_new_tokens)
        self.chat_template = chat_template
        self.prefix = task_prefix(decoder.pair, task, chat_template, data_dir) if prefix_cache else None
        self.reference = (GreedyReference(decoder.pair, self.stop, self.max_new_tokens, reference_cache, self.prefix)
                          if fidelity else None)

    def encode(self, pair, example: Example, turns_so_far: Sequence[str] = ()) -> list[int]:
        """Prompt ids of ``example``'s next turn (:func:`prompt_ids` with this runner's chat template setting)."""
        return prompt_ids(pair, example, self.chat_template, turns_so_far)

    def _turns(self, decoder: Decoder, example: Example) -> tuple[list[list[int]], list[list[int]], list, list[str]]:
        """Prompt ids, output ids, stats and cut texts of each turn (one turn for single-prompt tasks)."""
        prompts, outputs, stats, texts = [], [], [], []
        n_turns = len(example.turns) if example.turns else 1
        seed = self.seed_of(example)
        for turn in range(n_turns):
            ids = self.encode(decoder.pair, example, texts)
            result = decoder.generate(ids, max_new_tokens=self.max_new_tokens, seed=seed + turn, stop=self.stop,
                                      prefix=self.prefix)
            prompts.append(ids)
            outputs.append(result.token_ids)
            stats.append(result.stats)
            texts.append(cut_output(self.task, decoder.pair.decode(result.token_ids)))
        return prompts, outputs, stats, texts

    def seed_of(self, example: Example) -> int:
        """The seed ``example`` decodes with (turn t: this + t): its own, or the run's for every example."""
        return self.example_seed(self.seed, example.id) if self.example_seed else self.seed

    def warm_up(self, example: Example) -> None:
        """One short, discarded generation on ``example``'s (first) prompt: first-call costs stay out
        of the timed examples."""
        self.decoder.warm_up(self.encode(self.decoder.pair, example))

    def run_example(self, example: Example) -> dict:
        prompts, outputs, stats, texts = self._turns(self.decoder, example)
        record = {
            "id": example.id, "task": self.task, "method": self.decoder.config.label,
            "model": model_identity(self.decoder.pair),
            "output": texts if example.turns else texts[0],
            "score": score(example, texts[-1]) if not example.turns else score(example, "\n".join(texts)),
            "stats": merge_stats(stats).to_dict(), "seed": self.seed, "example_seed": self.seed_of(example),
            "seeding": "per-example" if self.example_seed else "run",
            "config": self.decoder.config.to_dict(), "sampling": asdict(self.decoder.sampling),
            "max_new_tokens": self.max_new_tokens, "chat_template": self.chat_template,
            "llm_judge": self.llm_judge.model if self.llm_judge is not None else None,
            "prompt_prefix": prefix_name(self.prefix),
        }
        if self.llm_judge is not None and example.turns:
            record["score"].update(judge_example(self.llm_judge, self.judge_prompts, example, texts,
                                                 self.judge_references))
        if self.reference is not None:
            greedy = [self.reference.lookup(p) for p in prompts]
            pair = self.decoder.pair
            per_turn = [compare_to_greedy(pair.target, p, out, ref["token_ids"], ref["nll"],
                                          self.reference.target_prefix).to_dict()
                        for p, out, ref in zip(prompts, outputs, greedy, strict=True)]
            diverged = [(t, f["first_divergence"]) for t, f in enumerate(per_turn) if f["first_divergence"] is not None]
            record["fidelity"] = {
                "exact_match": all(f["exact_match"] for f in per_turn),
                "first_divergence": diverged[0][1] if diverged else None,
                "first_divergence_turn": diverged[0][0] if diverged else None,
                "nll": sum(f["nll"] for f in per_turn) / len(per_turn),
                "greedy_nll": sum(f["greedy_nll"] for f in per_turn) / len(per_turn),
                "turns": per_turn,
            }
        return record


def run_task(decoder: Decoder, task: str, out: str | Path, *, limit: int | None = None, seed: int = 0,
             max_new_tokens: int | None = None, fidelity: bool = False, chat_template: bool = False,
             data_dir: str | Path | None = None, progress: bool = True,
             reference_cache: str | Path | None = None, llm_judge: JudgeEndpoint | None = None,
             warmup: bool = True, keyed: bool = False,
             example_seed: Callable[[int, str], int] | None = None, prefix_cache: bool = True) -> list[dict]:
    """Decode ``task`` into ``out`` (JSON lines), resuming what is already there. Returns all records.
    With ``warmup``, one short untimed generation on the first example to do comes first. With
    ``keyed``, the file is ``keyed_path(out, ...)``: one per configuration, none refused. With
    ``example_seed(seed, example id)``, each example decodes (and samples) from a seed of its own. With
    ``prefix_cache``, the prompts' shared beginning is prefilled once (:func:`task_prefix`; see the module).
    Holds ``results_lock(out)`` for the whole run: a second writer of ``out`` gets a ``ConfigError``."""
    wanted = {"task": task, "method": decoder.config.label, "model": model_identity(decoder.pair), "seed": seed,
              "config": decoder.config.to_dict(), "sampling": asdict(decoder.sampling),
              "max_new_tokens": new_token_budget(task, max_new_tokens),
              "seeding": "per-example" if example_seed else "run", "chat_template": chat_template,
              "llm_judge": llm_judge.model if llm_judge is not None else None}
    runner = TaskRunner(decoder, task, max_new_tokens=max_new_tokens, seed=seed, fidelity=fidelity,
                        chat_template=chat_template, reference_cache=reference_cache, llm_judge=llm_judge,
                        example_seed=example_seed, data_dir=data_dir, prefix_cache=prefix_cache)
    wanted["prompt_prefix"] = prefix_name(runner.prefix)
    judge_path = getattr(decoder.config, "judge_path", None)
    settings = {**wanted, "fidelity": fidelity, "judge_file": file_digest(judge_path)}
    if settings["prompt_prefix"] is None:  # the keys of runs without a prefix as they were before prefixes
        del settings["prompt_prefix"]
    out = keyed_path(out, settings) if keyed else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    note_models(decoder.pair)
    with results_lock(out):
        examples = load_task(task, data_dir=data_dir, limit=limit)
        label = decoder.config.label
        done_by_id = _records_to_resume(out, wanted, fidelity)
        env_path = out.with_suffix(out.suffix + ".env.json")
        if not env_path.exists():
            env_path.write_text(json.dumps(environment_record(decoder.pair.target.device), indent=1))
        todo = [e for e in examples if e.id not in done_by_id]
        bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=f"{task} {label}",
                   disable=not progress)
        if todo and warmup:
            runner.warm_up(todo[0])
        for example in todo:
            record = runner.run_example(example)
            append_result(out, record)
            done_by_id[example.id] = record
            bar.update(1)
        bar.close()
    return [done_by_id[e.id] for e in examples]  # this run's examples, in order, each once


def config_key(settings: dict) -> str:
    """A short, stable hash of ``settings`` (JSON-able values; key order does not matter)."""
    text = json.dumps(settings, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def file_digest(path: str | Path | None) -> str | None:
    """A hash of a file's bytes (a trained judge, retrained in place under the same name), if it exists."""
    if not path or not Path(path).is_file():
        return None
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]


def keyed_path(out: str | Path, settings: dict) -> Path:
    """``out`` with its settings in the name: ``<stem>__seed<seed>-new<max_new_tokens>-<hash>.jsonl``."""
    out = Path(out)
    readable = "-".join(f"{short}{settings[k]}" for k, short in (("seed", "seed"), ("max_new_tokens", "new"))
                        if k in settings)
    return out.with_name(f"{out.stem}__{readable + '-' if readable else ''}{config_key(settings)}{out.suffix}")


# fields records written before they existed hold implicitly
OLD_RECORD_DEFAULTS = {"seeding": "run", "chat_template": False, "llm_judge": None, "prompt_prefix": None}

MIN_PREFIX_TOKENS = 64  # a shared prompt beginning shorter than this is prefilled with each prompt
PREFIX_SAMPLE = 16  # examples, spread over the whole task, whose shared beginning is the task's prefix


def prompt_ids(pair, example: Example, chat_template: bool = False, turns_so_far: Sequence[str] = ()) -> list[int]:
    """Prompt ids of ``example``'s next turn (single-prompt tasks: its prompt). A chat template (chat tasks with
    ``chat_template``) already holds the BOS token, so none is added to it; every other prompt gets the
    tokenizer's special tokens."""
    if not example.turns:
        return pair.encode(example.prompt)
    prompt = chat_prompt(example.turns, list(turns_so_far), tokenizer=pair.tokenizer, use_chat_template=chat_template)
    if chat_template:
        return list(pair.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return pair.encode(prompt)


def task_prefix(pair, task: str, chat_template: bool = False, data_dir: str | Path | None = None) -> list[int] | None:
    """The token ids every prompt of ``task`` starts with (its few-shot exemplars), for ``pair``'s tokenizer: the
    beginning that :data:`PREFIX_SAMPLE` examples spread evenly over the whole task share (two alone may share
    more, e.g. KLUE-NLI's first and last the start of their premise); ``None`` below :data:`MIN_PREFIX_TOKENS`.
    Read from the whole task, so a run's prefix does not depend on its ``limit``; a prompt that shares less of
    it has only that much copied (:meth:`~dropmatch.prompt_cache.PromptPrefix.usable_length`)."""
    where = str(data_dir) if data_dir is not None else str(default_data_dir())  # the cache's key: a resolved path
    prefix = shared_prefix([prompt_ids(pair, e, chat_template) for e in _spread_examples(task, where)])
    return prefix if len(prefix) >= MIN_PREFIX_TOKENS else None


@functools.lru_cache(maxsize=32)
def _spread_examples(task: str, data_dir: str) -> tuple[Example, ...]:
    """:data:`PREFIX_SAMPLE` examples of ``task`` spread evenly over all of it (loaded once a process: MMLU's
    14k rows take seconds, and every method's run asks)."""
    examples = load_task(task, data_dir=data_dir)
    return tuple(examples[i] for i in sorted({round(k * (len(examples) - 1) / (PREFIX_SAMPLE - 1))
                                               for k in range(PREFIX_SAMPLE)}))


def prefix_digest(prefix: Sequence[int]) -> str:
    """A short hash of a prompt prefix's token ids."""
    return hashlib.sha1(json.dumps([int(i) for i in prefix]).encode()).hexdigest()[:10]


def prefix_name(prefix: Sequence[int] | None) -> str | None:
    """What records say of a prompt prefix: its length and :func:`prefix_digest` (``None`` without one)."""
    return f"{len(prefix)} tokens {prefix_digest(prefix)}" if prefix else None


def new_token_budget(task: str, max_new_tokens: int | None) -> int:
    """New tokens per generation (per turn): ``max_new_tokens``, or the task's default for ``None``;
    ``ConfigError`` below 1 (0 used to fall back to the default silently)."""
    if max_new_tokens is None:
        return generation_defaults(task).max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def _records_to_resume(out: Path, wanted: dict, fidelity: bool) -> dict[str, dict]:
    """The records already in ``out`` by id (a torn last line cut off); ``ConfigError`` if they come
    from another configuration."""
    done_by_id: dict[str, dict] = {}
    for record in read_results(out, key="id"):
        differs = [k for k, v in wanted.items() if record.get(k, OLD_RECORD_DEFAULTS.get(k)) != v]
        if differs:
            raise ConfigError(
                f"{out} already holds results of another run (different {', '.join(differs)}: "
                f"{', '.join(f'{k}={record.get(k)!r}' for k in differs[:3])}); this run is {wanted['task']}, "
                f"{wanted['method']}, {wanted['model']}. Use another --out"
                + (" (or --no-prefix-cache / prefix_cache=False for results decoded without a cached prompt prefix)."
                   if differs == ["prompt_prefix"] else ".")
            )
        if fidelity and "fidelity" not in record:
            raise ConfigError(f"{out} holds results without fidelity; use another --out for a run with --fidelity")
        done_by_id.setdefault(record["id"], record)
    return done_by_id
