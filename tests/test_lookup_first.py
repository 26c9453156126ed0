"""Lookup-first drafting: n-gram lookup where the context repeats, a model or EAGLE-3 drafter elsewhere."""

from __future__ import annotations

import pytest
import torch

from dropmatch.cli import build_parser, method_config
from dropmatch.drafters import Draft, LookupFirstDrafter, ModelDrafter, NgramDrafter
from dropmatch.drafters.eagle3 import Eagle3Drafter, init_head
from dropmatch.engine import generate
from dropmatch.errors import ConfigError
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.sampling import SamplingConfig

from .conftest import make_tiny
from .test_eagle3 import _exact_t4_marginal, random_head, tiny_head_config
from .test_sampling import P_MIN, _exact_joint, _pooled_pvalue

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pair():
    return make_tiny("llama", seed=3, vocab_size=64, layers=3)


def _features(target, layers, tokens: list[int]) -> torch.Tensor:
    return target.new_cache_with_features(torch.tensor(tokens), layers)[2]


# Steps after the prompt: (who proposes, the lookup's tokens, how many the target keeps). The target's own
# token after each step is 20 + the step's index. Covers a lookup step right after start, lookup steps in
# a row, none and all kept, and the drafter's own proposals between them.
PLAN = [("lookup", [40, 41, 42], 0), ("own", None, 1), ("lookup", [5, 6, 7], 2), ("lookup", [8], 1),
        ("lookup", [9, 10], 0), ("own", None, 0), ("lookup", [11, 12, 13], 3)]


def _drive(drafter, prompt: list[int], features, guess_every: int = 0) -> tuple[list[int], int]:
    """Run ``PLAN`` through ``drafter`` (``features(tokens)``: the target's states at ``tokens``, or None);
    return the context it was given and the newest token, for which it has yet to propose. With
    ``guess_every`` = k, every k-th step starts with ``first_guess`` (as guided lookup does)."""
    context, last = list(prompt), 17
    drafter.start(torch.tensor(context), features(context))
    for i, (who, tokens, kept) in enumerate(PLAN):
        if guess_every and i % guess_every == 0:
            drafter.first_guess(last)
        if who == "own":
            tokens = drafter.propose(last, 3, GREEDY, torch.Generator()).tokens.tolist()
        else:
            drafter.follow(last, tokens)
        context += [last, *tokens[:kept]]
        states = features(context)
        drafter.commit(kept, None if states is None else states[-(kept + 1):])  # at ``last`` and the kept tokens
        last = 20 + i
    return context, last


def _fresh_and_driven_drafts_agree(make, prompt: list[int], features, guess_every: int = 0) -> None:
    """A drafter driven through ``PLAN`` proposes the same tokens and logits as one started on the whole
    context: no row of the context is lost, doubled or fed out of order."""
    with torch.inference_mode():
        driven = make()
        context, last = _drive(driven, prompt, features, guess_every)
        got = driven.propose(last, 4, GREEDY, torch.Generator())
        fresh = make()
        fresh.start(torch.tensor(context), features(context))
        want = fresh.propose(last, 4, GREEDY, torch.Generator())
    assert got.tokens.tolist() == want.tokens.tolist()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("guess_every", [0, 1, 2])
def test_an_eagle3_head_that_sat_out_steps_drafts_as_if_it_had_seen_them(pair, window, guess_every):
    """Also when some or all steps, own or followed, began with a first guess (guided lookup)."""
    target = pair.target
    head = random_head(target, 40, seed=3)
    head.config.sliding_window = window
    prompt = torch.randint(3, 64, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    layers = Eagle3Drafter(head, target).feature_layers
    _fresh_and_driven_drafts_agree(lambda: Eagle3Drafter(head, target), prompt,
                                   lambda tokens: _features(target, layers, tokens), guess_every)


def test_an_eagle3_first_guess_is_the_first_draft_token_and_its_probability(pair):
    """``first_guess`` then ``propose`` drafts what ``propose`` alone does; the guess is the draft's first
    token, with its softmax probability under the draft logits."""
    target = pair.target
    head = random_head(target, 40, seed=4)
    prompt = torch.randint(3, 64, (11,), generator=torch.Generator().manual_seed(5))
    features = _features(target, Eagle3Drafter(head, target).feature_layers, prompt.tolist())
    drafts = []
    with torch.inference_mode():
        for guess_first in (False, True):
            drafter = Eagle3Drafter(head, target)
            drafter.start(prompt, features)
            guess = drafter.first_guess(9) if guess_first else None
            drafts.append(drafter.propose(9, 4, GREEDY, torch.Generator()))
    plain, guessed = drafts
    assert guessed.tokens.tolist() == plain.tokens.tolist() and len(plain.tokens) == 4
    torch.testing.assert_close(guessed.logits, plain.logits)
    token, probability = guess
    assert token == plain.tokens[0]
    assert probability == pytest.approx(float(torch.softmax(plain.logits[0], -1)[token]), rel=1e-5)


class GuessingStub:
    """A following drafter whose first guess is set by the test; its own proposal is ``OWN``."""

    name = "stub"
    OWN = [60, 61]

    def __init__(self, guess: int, confidence: float):
        self.guess, self.confidence, self.calls = guess, confidence, []

    def start(self, prompt_ids, features=None):
        self.calls = []

    def first_guess(self, last_token):
        self.calls.append("guess")
        return self.guess, self.confidence

    def propose(self, last_token, n, sampling, generator):
        self.calls.append("propose")
        return Draft(torch.tensor(self.OWN[:n]))

    def follow(self, last_token, tokens):
        self.calls.append("follow")

    def commit(self, n_accepted, features=None):
        pass


# the context ends in (5, 9); earlier (5, 9) was followed by 12 (latest), 30 and 7; (9) alone also by 41
GUIDE_CONTEXT = [5, 9, 7, 8, 5, 9, 30, 41, 9, 41, 5, 9, 12, 3, 5, 9]


@pytest.mark.parametrize("guess, confidence, want, calls", [
    (12, 0.9, [12, 3, 5], ["guess", "follow"]),  # the head agrees with the latest match
    (30, 0.1, [30, 41, 9], ["guess", "follow"]),  # it picks an older match of the same bigram
    (7, 0.9, [7, 8, 5], ["guess", "follow"]),  # the oldest one
    (41, 0.1, [41, 5, 9], ["guess", "follow"]),  # a shorter n-gram's match
    (50, 0.7, GuessingStub.OWN, ["guess", "propose"]),  # none agrees; confident: its own draft
    (50, 0.3, [12, 3, 5], ["guess", "follow"]),  # none agrees; unsure: the latest match
    (50, 0.5, GuessingStub.OWN, ["guess", "propose"]),  # at the guide itself: its own draft
])
def test_guided_lookup_proposes_the_match_the_head_guesses(guess, confidence, want, calls):
    stub = GuessingStub(guess, confidence)
    drafter = LookupFirstDrafter(stub, max_ngram=2, min_match=1, guide_at=0.5)
    drafter.start(torch.tensor(GUIDE_CONTEXT[:-1]))
    assert drafter.propose(GUIDE_CONTEXT[-1], 3, GREEDY, torch.Generator()).tokens.tolist() == want
    assert stub.calls == calls
    assert drafter.guided_steps == (want != [12, 3, 5])
    unguided = LookupFirstDrafter(GuessingStub(guess, confidence), max_ngram=2, min_match=1)
    unguided.start(torch.tensor(GUIDE_CONTEXT[:-1]))
    assert unguided.propose(GUIDE_CONTEXT[-1], 3, GREEDY, torch.Generator()).tokens.tolist() == [12, 3, 5]
    assert unguided.drafter.calls == ["follow"]  # without a guide the head sits lookup steps out


def test_a_draft_model_that_sat_out_steps_drafts_as_if_it_had_seen_them(pair):
    prompt = torch.randint(3, 64, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    _fresh_and_driven_drafts_agree(lambda: ModelDrafter(pair.draft), prompt, lambda tokens: None)


@pytest.mark.parametrize("fallback", ["eagle3", "model", "guided eagle3"])
def test_greedy_sd_with_lookup_first_equals_ar(pair, fallback):
    """Greedy SD equals AR token for token, with proposals from both the lookup and the drafter."""
    target = pair.target
    prompt = torch.tensor([5, 9, 12, 5, 9, 30, 41, 5, 9, 12, 7, 3])
    ar = generate(target, prompt, max_new_tokens=40).token_ids
    for draft_len in (1, 3, 6):
        inner = Eagle3Drafter(random_head(target, 40, seed=3), target) if "eagle3" in fallback else ModelDrafter(pair.draft)
        drafter = LookupFirstDrafter(inner, max_ngram=3, min_match=1, guide_at=0.15 if "guided" in fallback else None)
        out = generate(target, prompt, drafter=drafter, draft_len=draft_len, max_new_tokens=40)
        assert out.token_ids == ar
        assert drafter.lookup_steps > 0 and drafter.drafter_steps > 0
        assert (drafter.guided_steps > 0) == ("guided" in fallback)  # the guide changed some proposals


@pytest.mark.parametrize("fallback", ["eagle3", "model", "guided eagle3"])
def test_speculative_sampling_with_lookup_first_preserves_target_distribution(fallback):
    """Tokens 2-3 (joint) and 4 of SD runs at L = 3 match plain sampling when one-hot lookup drafts and
    the fallback's drafts (EAGLE-3 head or draft model, with their distributions) alternate: the prompt
    repeats, so the first step always looks up, and later steps look up or fall back depending on what
    was sampled (both counted)."""
    vocab = 10
    pair = make_tiny("llama", seed=5, vocab_size=vocab)
    target, sampling = pair.target, SamplingConfig(1.0)
    prompt = torch.tensor([2, 3, 4, 3, 5, 3])
    with torch.no_grad():
        likeliest = target.model(prompt[None]).logits[0, -1].topk(6).indices
    head = init_head(tiny_head_config(target, 6), target, likeliest, seed=7).eval().requires_grad_(False)

    def fallback_drafter():
        return Eagle3Drafter(head, target) if "eagle3" in fallback else ModelDrafter(pair.draft)

    joint = _exact_joint(target, prompt, vocab, sampling).flatten()
    t4 = _exact_t4_marginal(target, prompt, vocab, sampling)
    counts, counts4 = torch.zeros(vocab * vocab), torch.zeros(vocab)
    lookups = fallbacks = deep = guided = 0
    for seed in range(1500):
        drafter = LookupFirstDrafter(fallback_drafter(), max_ngram=2, min_match=1,
                                     guide_at=0.3 if "guided" in fallback else None)
        out = generate(target, prompt, drafter=drafter, draft_len=3, max_new_tokens=5, sampling=sampling, seed=seed)
        guided += drafter.guided_steps
        counts[out.token_ids[1] * vocab + out.token_ids[2]] += 1
        counts4[out.token_ids[3]] += 1
        lookups, fallbacks = lookups + drafter.lookup_steps, fallbacks + drafter.drafter_steps
        deep += out.stats.accepted_per_step[0] >= 2
    assert lookups > 300 and fallbacks > 300 and deep > 50, (lookups, fallbacks, deep)
    assert (guided > 100) == ("guided" in fallback), guided
    for observed, expected in ((counts, joint), (counts4, t4)):
        assert _pooled_pvalue(observed, expected.double() / expected.double().sum()) > P_MIN


def test_lookup_first_is_named_keyed_checked_and_built(pair):
    """The option shows in the label and the result key (configurations without it keep their keys),
    reaches the drafter from the CLI, and is refused where it means nothing."""
    config = MethodConfig("sd", lookup_first=True, draft_len=8)
    assert config.label == "sd[lookup_first]@L8"
    assert MethodConfig("sd", draft="eagle3", lookup_first=True, lookup_min=1).label == \
        "sd+eagle3[lookup_first,lookup_min=1]@L5"
    plain = MethodConfig("sd").to_dict()
    assert "lookup_first" not in plain and "lookup_min" not in plain and config.to_dict()["lookup_first"] is True
    assert MethodConfig(**config.to_dict()) == config
    drafter = Decoder(pair, config).drafter
    assert isinstance(drafter, LookupFirstDrafter) and isinstance(drafter.drafter, ModelDrafter)
    assert not isinstance(Decoder(pair, MethodConfig("sd")).drafter, LookupFirstDrafter)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--lookup-first", "--lookup-min", "3"])
    assert method_config(args).lookup_first and method_config(args).lookup_min == 3
    dropmatch = Decoder(pair, MethodConfig("dropmatch", criterion="js+majority", lookup_first=True, lookup_min=1))
    out = dropmatch.generate([5, 9, 12, 5, 9, 30, 41, 5, 9, 12], max_new_tokens=24)  # one-hot lookup drafts, model drafts
    assert len(out.token_ids) == 24 or out.token_ids[-1] in pair.eos_token_ids  # lossy: may reach EOS sooner
    assert dropmatch.drafter.lookup_steps > 0 and dropmatch.drafter.drafter_steps > 0
    with pytest.raises(ConfigError, match="lookup-first"):
        MethodConfig("sd", draft="ngram", lookup_first=True)
    for bad in (dict(lookup_first=True, lookup_min=4), dict(lookup_first=True, lookup_min=0), dict(lookup_min=1)):
        with pytest.raises(ConfigError, match="lookup-min"):
            MethodConfig("sd", **bad)
    with pytest.raises(ConfigError, match="follow"):
        LookupFirstDrafter(NgramDrafter())


def test_lookup_guide_is_named_keyed_checked_and_built(pair):
    """``--lookup-guide`` reaches the drafter from the CLI, shows in the label and the key only when set,
    and is refused without an EAGLE-3 head behind lookup first, or outside [0, 1]."""
    config = MethodConfig("sd", draft="eagle3", lookup_first=True, lookup_guide=0.5, draft_len=8)
    assert config.label == "sd+eagle3[lookup_first,lookup_guide=0.5]@L8"
    assert config.to_dict()["lookup_guide"] == 0.5 and MethodConfig(**config.to_dict()) == config
    assert "lookup_guide" not in MethodConfig("sd", draft="eagle3", lookup_first=True).to_dict()
    args = build_parser().parse_args(["generate", "--prompt", "x", "--draft", "eagle3", "--lookup-first",
                                      "--lookup-guide", "0.4"])
    assert method_config(args).lookup_guide == 0.4
    for bad in (dict(draft="eagle3", lookup_guide=0.5), dict(lookup_first=True, lookup_guide=0.5),
                dict(draft="eagle3", lookup_first=True, lookup_guide=1.5)):
        with pytest.raises(ConfigError, match="lookup-guide"):
            MethodConfig("sd", **bad)
    with pytest.raises(ConfigError, match="guesses its first token"):
        LookupFirstDrafter(ModelDrafter(pair.draft), guide_at=0.5)
    with pytest.raises(ConfigError, match="lookup guide"):
        LookupFirstDrafter(Eagle3Drafter(random_head(pair.target, 40), pair.target), guide_at=-0.1)
