"""The embedded pair: Gemma-3-270M float32 target, int8 self-draft (converted and cached on first use)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dropmatch.drafters import ModelDrafter
from dropmatch.engine import generate
from dropmatch.heads import bf16_matmul_supported
from dropmatch.methods import Decoder, MethodConfig

pytestmark = pytest.mark.gemma

# Our own short prompts: English math, Python code, Korean text.
PROMPTS = {
    "math": "Question: Tom has 3 boxes with 4 apples each. How many apples does he have?\n"
            "Answer: 3 boxes with 4 apples each make 3 * 4 = 12 apples. #### 12\n\n"
            "Question: A farmer has 12 cows and buys 7 more. Each cow gives 3 liters of milk a day. "
            "How many liters does the farmer get per day?\nAnswer:",
    "code": 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "korean": "서울은 대한민국의 수도이며, 한강이 도시를 가로질러 흐른다. 서울에는 많은 궁궐과",
}


def test_pair_shapes(gemma):
    assert gemma.target.vocab_size == gemma.draft.vocab_size == 262144
    assert gemma.target.head_weight.dtype == torch.float32
    assert "quantized" in type(gemma.draft.lm_head).__module__  # the untied head is int8 too
    # fp32, bias-free, 262k rows on the CPU: the screened bf16 head is on exactly where bf16 GEMMs are native
    assert gemma.target.fast_head == bf16_matmul_supported()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_sd_equals_ar(gemma, name):
    ids = gemma.encode(PROMPTS[name])
    ar = generate(gemma.target, ids, max_new_tokens=40, eos_token_ids=gemma.eos_token_ids)
    sd = generate(gemma.target, ids, drafter=ModelDrafter(gemma.draft), draft_len=5, max_new_tokens=40,
                  eos_token_ids=gemma.eos_token_ids)
    assert sd.token_ids == ar.token_ids
    assert sd.stats.tau > 1.5


def test_cut_drafts_keep_the_steps_on_fewer_head_rows(gemma):
    """Cutting drafts at certain rejections (the default; :func:`~dropmatch.engine.cut_draft`) changes no
    step of greedy SD on the real pair, and the context shows the rejections."""
    ids = gemma.encode(PROMPTS["math"])
    cut, whole = (generate(gemma.target, ids, drafter=ModelDrafter(gemma.draft), draft_len=5, max_new_tokens=40,
                           eos_token_ids=gemma.eos_token_ids, cut_drafts=c) for c in (True, False))
    assert cut.token_ids == whole.token_ids and cut.stats.accepted_per_step == whole.stats.accepted_per_step
    assert whole.stats.head_rows_per_step == [d + 1 for d in whole.stats.drafted_per_step]
    assert sum(cut.stats.head_rows_per_step) < sum(whole.stats.head_rows_per_step)


def test_a_cached_exemplar_prefix_gives_the_cold_steps(gemma):
    """Two questions after the same worked examples: greedy SD started from the target's cached examples
    takes the cold run's steps. The examples are longer than the sliding window (512) of five in six layers.
    The int8 draft started from its own may draft otherwise (dynamic quantization scales activations per call,
    so a split prefill moves its states), and the tokens stay AR's."""
    exemplar = PROMPTS["math"].split("Question: A farmer")[0] * 12
    shared = gemma.encode(exemplar)
    assert len(shared) > 512 + 20
    prefix, draft_prefix = gemma.target.cache_prefix(shared), gemma.draft.cache_prefix(shared)
    for question in ("Question: Ann reads 5 pages a day for 6 days. How many pages?\nAnswer:",
                     "Question: A bag holds 8 red and 9 blue balls. How many balls?\nAnswer:"):
        ids = gemma.encode(exemplar + question)
        cold, warm, both = (generate(gemma.target, ids, drafter=ModelDrafter(gemma.draft, prefix=d), draft_len=5,
                                     max_new_tokens=24, eos_token_ids=gemma.eos_token_ids, prefix=p)
                            for p, d in ((None, None), (prefix, None), (prefix, draft_prefix)))
        assert warm.token_ids == cold.token_ids and warm.stats.accepted_per_step == cold.stats.accepted_per_step
        assert both.token_ids == cold.token_ids
        assert warm.stats.cached_prompt_tokens == prefix.usable_length(torch.tensor(ids)) > 512


def test_screened_head_is_exact_where_it_matters(gemma):
    target = gemma.target
    ids = torch.tensor(gemma.encode(PROMPTS["math"] + PROMPTS["korean"]))
    with torch.inference_mode():
        _, hidden = target.new_cache(prompt_ids=ids)
        exact = F.linear(hidden, target.head_weight)
        if not target.fast_head:
            pytest.skip("no native bfloat16 GEMM on this CPU: the screened head is off")
        screened = target.head(hidden, exact=False)
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    likely = exact >= exact.amax(-1, keepdim=True) - 4.0  # within 4 nats of the top: float32 values
    torch.testing.assert_close(screened[likely], exact[likely], atol=1e-4, rtol=1e-5)
    tv = 0.5 * (torch.softmax(screened, -1) - torch.softmax(exact, -1)).abs().sum(-1)
    assert float(tv.max()) < 0.02


def test_p_drop_zero_equals_sd(gemma):
    ids = gemma.encode(PROMPTS["code"])
    sd = Decoder(gemma, MethodConfig("sd")).generate(ids, max_new_tokens=32)
    dm = Decoder(gemma, MethodConfig("dropmatch", p_drop=0.0)).generate(ids, max_new_tokens=32)
    assert dm.token_ids == sd.token_ids
    assert dm.stats.accepted_per_step == sd.stats.accepted_per_step


def test_dropmatch_raises_tau_over_sd(gemma):
    """Mean tau over math, code and Korean prompts (greedy, L = 5, K = 5, p_drop = 0.3)."""
    sd_tau, dm_tau, extra = [], [], 0
    for text in PROMPTS.values():
        ids = gemma.encode(text)
        sd_tau.append(Decoder(gemma, MethodConfig("sd")).generate(ids, max_new_tokens=48).stats.tau)
        dm = Decoder(gemma, MethodConfig("dropmatch")).generate(ids, max_new_tokens=48)
        dm_tau.append(dm.stats.tau)
        extra += dm.stats.extra_accepts
    print(f"mean tau: sd {sum(sd_tau) / 3:.3f}, dropmatch {sum(dm_tau) / 3:.3f}")
    assert extra > 0
    assert sum(dm_tau) > sum(sd_tau)


@pytest.mark.parametrize("p_drop", [0.032, 0.3])
def test_certified_heads_decide_as_exact_float32_heads(gemma, p_drop):
    """The default heads of greedy js+majority (8-bit bag or int8 GEMM corrections on x86, certified on
    screened clean logits) take every decision that exact float32 heads take: same tokens, same acceptances,
    on math, code and Korean, with most decisions certified (not recomputed exactly). Positions are both accepted
    and rejected at p_drop 0.032; at 0.3 js+majority accepts nearly every position it is asked about."""
    accepted = evaluated = fell_back = 0
    for text in PROMPTS.values():
        ids = gemma.encode(text)
        decoders = [Decoder(gemma, MethodConfig("dropmatch", p_drop=p_drop, criterion="js+majority", head_dtype=dtype))
                    for dtype in (None, "float32")]
        runs = [decoder.generate(ids, max_new_tokens=32) for decoder in decoders]
        assert runs[0].token_ids == runs[1].token_ids, text
        assert runs[0].stats.accepted_per_step == runs[1].stats.accepted_per_step, text
        counters = decoders[0].rule.criterion.counters
        accepted, evaluated = accepted + runs[0].stats.extra_accepts, evaluated + counters.evaluations
        fell_back += counters.exact_fallbacks
    assert accepted > 0 and (p_drop > 0.1 or accepted < evaluated)
    assert fell_back < evaluated / 2
