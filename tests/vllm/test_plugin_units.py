"""The plugin's pure parts (no vLLM needed): settings, the greedy relaxation, masks and heads."""

from __future__ import annotations

import pytest
import torch

from dropmatch.errors import ConfigError
from dropmatch.vllm_plugin.config import DropMatchVllmConfig, from_additional_config
from dropmatch.vllm_plugin.heads import draw_masks, dropout_head_logits, position_seed, request_key
from dropmatch.vllm_plugin.metrics import aggregate, extra_accepted_for, per_position_acceptance
from dropmatch.vllm_plugin.relax import PLACEHOLDER_TOKEN_ID, relax_greedy

P = PLACEHOLDER_TOKEN_ID


def test_config_parsing_and_refusals():
    assert from_additional_config({}) is None and from_additional_config(None) is None
    cfg = from_additional_config({"dropmatch": {"k": 3, "p_drop": 0.2, "criterion": "naive", "seed": 7}})
    assert cfg == DropMatchVllmConfig(k=3, p_drop=0.2, criterion="naive", seed=7)
    with pytest.raises(ConfigError, match="K .* must be an integer >= 1"):
        from_additional_config({"dropmatch": {"k": 0}})
    with pytest.raises(ConfigError, match="unknown DropMatch criterion 'jsd'"):
        from_additional_config({"dropmatch": {"criterion": "jsd"}})
    with pytest.raises(ConfigError, match="p_drop must be in"):
        from_additional_config({"dropmatch": {"p_drop": 1.0}})
    with pytest.raises(ConfigError, match="unknown dropmatch option.*kk"):
        from_additional_config({"dropmatch": {"kk": 5}})
    with pytest.raises(ConfigError, match="must be a mapping"):
        from_additional_config({"dropmatch": 5})
    with pytest.raises(ConfigError, match="enabled must be true or false"):
        from_additional_config({"dropmatch": {"enabled": "false"}})  # a string: truthy


def _batch():
    # request 0: drafts 10 11 12 13, target argmax 10 99 12 98 (exact match accepts 1)
    # request 1: drafts 20 21, argmax 20 21 (all accepted: bonus 7)
    # request 2: no drafts
    drafts = torch.tensor([10, 11, 12, 13, 20, 21])
    argmax = torch.tensor([10, 99, 12, 98, 20, 21])
    num = [4, 2, 0]
    bonus = torch.tensor([[5], [7], [9]])
    vllm_out = torch.tensor([[10, 99, P, P, P], [20, 21, 7, P, P], [9, P, P, P, P]], dtype=torch.int32)
    return vllm_out, drafts, num, argmax, bonus


def test_relax_rejecting_criterion_keeps_vllm_output():
    out, drafts, num, argmax, bonus = _batch()
    calls = []
    res = relax_greedy(out, drafts, num, argmax, bonus, lambda flat: calls.append(flat) or [False] * len(flat))
    assert res.output is out and res.extra_accepted == [0, 0, 0]
    assert calls == [[1]] and res.positions_tested == 1  # only request 0's first rejection is judged


def test_relax_walks_exact_match_then_criterion_again():
    out, drafts, num, argmax, bonus = _batch()
    calls = []

    def accept(flat):
        calls.append(flat)
        return [f == 1 for f in flat]  # accept position 1, reject position 3

    res = relax_greedy(out, drafts, num, argmax, bonus, accept)
    # 10 (exact), 11 (DropMatch), 12 (exact), then position 3 rejected: recovered = argmax 98
    assert res.output[0].tolist() == [10, 11, 12, 98, P]
    assert res.output[1].tolist() == out[1].tolist() and res.output[2].tolist() == out[2].tolist()
    assert res.extra_accepted == [1, 0, 0] and calls == [[1], [3]]


def test_relax_all_accepted_ends_with_bonus_and_respects_rows():
    out, drafts, num, argmax, bonus = _batch()
    res = relax_greedy(out, drafts, num, argmax, bonus, lambda flat: [True] * len(flat))
    assert res.output[0].tolist() == [10, 11, 12, 13, 5] and res.extra_accepted == [2, 0, 0]
    untouched = relax_greedy(out, drafts, num, argmax, bonus, lambda flat: [True] * len(flat), rows=[1, 2])
    assert untouched.output is out and untouched.positions_tested == 0


def test_relax_batches_one_call_per_round():
    drafts = torch.tensor([1, 2, 3, 4])
    argmax = torch.tensor([9, 9, 9, 9])
    out = torch.tensor([[9, P, P], [9, P, P]], dtype=torch.int32)
    calls = []
    res = relax_greedy(out, drafts, [2, 2], argmax, torch.tensor([0, 0]),
                       lambda flat: calls.append(flat) or [True] * len(flat))
    assert calls == [[0, 2], [1, 3]]
    assert res.output.tolist() == [[1, 2, 0], [3, 4, 0]]


def test_masks_are_seeded_per_position_not_per_batch():
    seeds = [position_seed(0, request_key([1, 2, 3]), pos) for pos in (5, 6)]
    both = draw_masks(seeds, k=4, d=64, p_drop=0.3, device=torch.device("cpu"))
    alone = draw_masks(seeds[1:], k=4, d=64, p_drop=0.3, device=torch.device("cpu"))
    assert torch.equal(both[1], alone[0]) and not torch.equal(both[0], both[1])
    assert position_seed(0, 1, 2) == position_seed(0, 1, 2) != position_seed(1, 1, 2)
    assert 0.55 < both.float().mean() < 0.85  # keep probability 0.7


def test_heads_go_through_compute_logits_and_are_exact_at_p0():
    torch.manual_seed(0)
    weight = torch.randn(50, 16)
    calls = []

    def compute_logits(x):
        calls.append(x.clone())
        return x @ weight.T

    hidden = torch.randn(3, 16)
    masks = draw_masks([1, 2, 3], k=5, d=16, p_drop=0.0, device=torch.device("cpu"))
    heads = dropout_head_logits(compute_logits, hidden, masks, 0.0)
    # one (m * K, d) batch whose rows are exactly the hidden states at p_drop = 0
    assert len(calls) == 1 and torch.equal(calls[0], hidden.repeat_interleave(5, dim=0))
    assert heads.shape == (3, 5, 50) and torch.equal(heads[:, 0], heads[:, 4])
    torch.testing.assert_close(heads[:, 0], hidden @ weight.T)
    masks = draw_masks([1, 2, 3], k=5, d=16, p_drop=0.5, device=torch.device("cpu"))
    heads = dropout_head_logits(compute_logits, hidden, masks, 0.5)
    expected = (hidden.unsqueeze(1) * masks / 0.5) @ weight.T
    torch.testing.assert_close(heads, expected)


def test_metrics_from_vllm_histograms():
    assert per_position_acceptance([2, 1, 0, 1]) == [0.5, 0.25, 0.25]
    m = {"num_spec_steps": 4, "num_accepted_draft_tokens": 4, "num_draft_tokens": 12, "acceptance_histogram": [2, 1, 0, 1]}
    total = aggregate([m, None, m])
    assert total["mean_acceptance_length"] == 2.0 and total["acceptance_histogram"] == [4, 2, 0, 2]


def _context(favourite: int, config: DropMatchVllmConfig):
    """A verify step of one request with 2 drafts whose heads (a fake ``compute_logits``) all pick ``favourite``."""
    from dropmatch.vllm_plugin.sampler import DropMatchState, VerifyContext

    def compute_logits(x):
        logits = torch.zeros(x.shape[0], 8)
        logits[:, favourite] = 5.0
        return logits

    return VerifyContext(state=DropMatchState(config), compute_logits=compute_logits,
                         sample_hidden_states=torch.randn(3, 4), target_logits_indices=torch.tensor([0, 1]),
                         req_ids=["req-0"], prompt_token_ids=[[1, 2, 3]], first_positions=[3])


def test_relax_step_accepts_through_the_criterion_and_counts():
    from types import SimpleNamespace

    from dropmatch.vllm_plugin.sampler import relax_step

    target_logits = torch.zeros(2, 8)
    target_logits[:, 5] = 1.0  # the target wants 5 at both positions; the drafts are 3, 3
    drafts, out = torch.tensor([3, 3]), torch.tensor([[5, P, P]], dtype=torch.int32)
    greedy = SimpleNamespace(all_greedy=True)
    ctx = _context(3, DropMatchVllmConfig(k=3, p_drop=0.3, criterion="naive"))
    new = relax_step(ctx, out, drafts, [2], None, target_logits, torch.tensor([[7]]), greedy)
    assert new.tolist() == [[3, 3, 7]]  # both drafts accepted by the heads, then the bonus token
    assert ctx.state.stats.as_dict() == {"verify_steps": 1, "positions_tested": 2, "extra_accepted": 2,
                                         "per_request": {"req-0": 2}}
    # heads that pick another token: nothing changes
    ctx = _context(6, DropMatchVllmConfig(k=3, p_drop=0.3, criterion="naive"))
    assert relax_step(ctx, out, drafts, [2], None, target_logits, torch.tensor([[7]]), greedy) is out
    # p_drop = 0: the heads are vLLM's verified logits themselves, not a recomputation (which these heads,
    # picking 3, stand for: a near-tie broken otherwise by the batch shape), so nothing more is accepted
    ctx = _context(3, DropMatchVllmConfig(k=3, p_drop=0.0, criterion="naive"))
    assert relax_step(ctx, out, drafts, [2], None, target_logits, torch.tensor([[7]]), greedy) is out
    assert ctx.state.stats.positions_tested == 1 and ctx.state.stats.extra_accepted == 0
    # p_drop = 0 with JS: a draft whose top two are the target's, swapped by 1e-3..1e-5 nats, is not accepted
    # (K equal heads' centroid and the JS sums carried float32 noise that accepted such drafts)
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        near = torch.randn(2, 300, generator=g) * 3
        top, second = near[0].topk(2).indices.tolist()
        gap = 10.0 ** (-(trial % 3) - 3)
        near[:, second] = near[:, top] - gap
        draft_logits = near.clone()
        draft_logits[:, second] = near[:, top] + gap
        out_near = torch.tensor([[top, P, P]], dtype=torch.int32)
        ctx = _context(3, DropMatchVllmConfig(k=5, p_drop=0.0, criterion="js"))
        assert relax_step(ctx, out_near, torch.tensor([second, second]), [2], torch.softmax(draft_logits, -1), near,
                          torch.tensor([[7]]), greedy) is out_near, trial
    # a draft token vLLM's logits processors forbid (-inf) is never accepted
    target_logits[1, 3] = float("-inf")
    ctx = _context(3, DropMatchVllmConfig(k=3, p_drop=0.3, criterion="naive"))
    new = relax_step(ctx, out, drafts, [2], None, target_logits, torch.tensor([[7]]), greedy)
    assert new.tolist() == [[3, 5, P]]


def test_extra_accepted_for_matches_vllms_request_ids_only():
    # vLLM 0.32 makes "q" unique as "q-<8 hex digits>"; "q-2" is another request, as is "dropmatch-js-0"
    stats = {"per_request": {"q-1a2b3c4d": 3, "q-2-5e6f7a8b": 7, "dropmatch-0a1b2c3d": 2, "dropmatch-js-0-9f8e7d6c": 5,
                             "plain": 4}}
    assert extra_accepted_for(stats, "q") == 3 and extra_accepted_for(stats, "q-2") == 7
    assert extra_accepted_for(stats, "dropmatch") == 2 and extra_accepted_for(stats, "dropmatch-js-0") == 5
    assert extra_accepted_for(stats, "plain") == 4  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION: the id itself
    assert extra_accepted_for(stats, "r") == 0 and extra_accepted_for({}, "q") == 0
