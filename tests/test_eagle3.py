"""EAGLE-3 head: shapes, training-time test == chain drafting, training, checkpoints, lossless decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from scipy.stats import chisquare

from dropmatch.draft_training import TTTAttention, ttt_loss
from dropmatch.drafters.eagle3 import (
    ARCHITECTURE,
    Eagle3Cache,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    committed_head,
    init_head,
    load_head,
    save_head,
)
from dropmatch.engine import generate
from dropmatch.errors import ConfigError, ModelNotFoundError
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.models import CausalLM, ModelPair
from dropmatch.sampling import SamplingConfig

from .conftest import make_tiny
from .test_sampling import P_MIN, _exact_joint


def tiny_head_config(target, draft_vocab: int, **kw) -> Eagle3Config:
    d = int(target.head_weight.shape[1])
    return Eagle3Config(hidden_size=d, intermediate_size=2 * d, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab,
                        feature_layers=(1, 1, 2), **kw)


def random_head(target, draft_vocab: int | None = None, seed: int = 0, scale: float = 1.0) -> Eagle3Head:
    """A random-init head (all weights random, ``vocabulary`` = a seeded subset of the target's)."""
    n = draft_vocab or target.vocab_size
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(target.vocab_size, generator=g)[:n]
    head = init_head(tiny_head_config(target, n), target, vocab, seed=seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=g) * scale / param.shape[1] ** 0.5)
    return head.eval().requires_grad_(False)


def in_bfloat16(head: Eagle3Head) -> Eagle3Head:
    """A bfloat16 copy of ``head`` with float32 rotary frequencies, as ``load_head(dtype=torch.bfloat16)``
    makes it."""
    narrow = copy.deepcopy(head).to(torch.bfloat16)
    for name, value in head.rotary.named_buffers():
        setattr(narrow.rotary, name, value)
    return narrow


@pytest.fixture(scope="module")
def pair():
    return make_tiny("llama", seed=3, vocab_size=64, layers=3)


def test_head_shapes_and_fc_only_on_wide_inputs(pair):
    head = random_head(pair.target, 40)
    d = head.config.hidden_size
    embeds = torch.randn(2, 5, d)
    pos = torch.arange(5).expand(2, 5)
    root = head.state(embeds, torch.randn(2, 5, 3 * d), pos, TTTAttention())
    assert root.shape == (2, 5, d)
    assert head.logits(root).shape == (2, 5, 40)
    calls = []
    handle = head.fc.register_forward_hook(lambda *a: calls.append(1))
    deeper = head.state(embeds[:1, :1], root[:1, -1:], pos[:1, :1], Eagle3Cache().attend)
    handle.remove()
    assert deeper.shape == (1, 1, d) and not calls
    ids = head.draft_to_target
    assert torch.equal(head.t2d.nonzero().view(-1), ids) and ids.unique().numel() == 40


def test_training_time_test_matches_chain_drafting(pair):
    """Step j of the TTT unroll at row p == the chain drafter's depth-j state after feeding rows 0..p."""
    head = random_head(pair.target, seed=1)
    embed = pair.target.model.get_input_embeddings()
    d, t, steps = head.config.hidden_size, 7, 3
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, t, 3 * d, generator=g)
    tokens = torch.randint(3, 64, (1, t + steps), generator=g)
    attend = TTTAttention()
    hidden, ttt_states = feats, []
    for j in range(steps):
        hidden = head.state(embed(tokens[:, 1 + j : 1 + j + t]), hidden, torch.arange(t).view(1, -1) + j, attend)
        ttt_states.append(hidden)
    for p in (0, 3, t - 1):
        cache = Eagle3Cache()
        state = head.state(embed(tokens[:, 1 : p + 2]), feats[:, : p + 1], torch.arange(p + 1).view(1, -1),
                           cache.attend)[:, -1:]
        torch.testing.assert_close(state, ttt_states[0][:, p : p + 1], atol=1e-5, rtol=1e-4)
        for j in range(1, steps):
            state = head.state(embed(tokens[:, p + 1 + j : p + 2 + j]), state, torch.tensor([[p + j]]), cache.attend)
            torch.testing.assert_close(state, ttt_states[j][:, p : p + 1], atol=1e-5, rtol=1e-4)


def test_training_steps_reduce_the_loss(pair):
    target = pair.target
    vocab = torch.arange(3, 43)
    head = init_head(tiny_head_config(target, 40), target, vocab, seed=0)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 12, 3 * head.config.hidden_size, generator=g)
    tokens = torch.randint(3, 64, (2, 12), generator=g)
    logits = torch.randn(2, 12, 40, generator=g) * 3
    values, ids = logits.topk(8, dim=-1)
    embed = target.model.get_input_embeddings()
    params = [p for p in head.parameters() if p.requires_grad]
    assert all(p is not head.lm_head.weight for p in params)  # tied to the target's rows, frozen
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(15):
        loss, accs, counts = ttt_loss(head, embed, feats, tokens, ids, values.half(), steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(accs) == 3 and counts == [2 * 11, 2 * 10, 2 * 9]
    assert losses[-1] < 0.8 * losses[0]


LAYER_IDS = {  # how each producer's config.json names the target layers of feature_layers
    "eagle": lambda layers: {},  # SafeAILab/EAGLE: none written, the default (2, L // 2, L - 3) hard-coded
    "specforge": lambda layers: {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}},
    "speculators": lambda layers: {"eagle_aux_hidden_state_layer_ids": list(layers)},  # as vLLM reads them
}


def _public_checkpoint(path, head: Eagle3Head, prefix: str = "", layer: str = "midlayer.", producer: str = "specforge",
                       embed: torch.Tensor | None = None) -> None:
    """A checkpoint written as the public heads are (no dropmatch code): config.json + safetensors, the
    layer ids in ``producer``'s convention, and ``embed`` (if any) as embed_tokens.weight."""
    from safetensors.torch import save_file

    c = head.config
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float32",
        "target_hidden_size": c.target_hidden_size, **LAYER_IDS[producer](c.feature_layers)}))
    state = {}
    for name, value in head.state_dict().items():
        if name.startswith("rotary"):
            continue
        name = name.replace("midlayer.", layer)
        state[prefix + name if name not in ("d2t", "t2d") else name] = value.contiguous()
    if embed is not None:
        state[prefix + "embed_tokens.weight"] = embed.contiguous()
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("producer,prefix,layer", [("specforge", "", "midlayer."), ("speculators", "", "layers.0."),
                                                   ("speculators", "model.", "layers.0."), ("eagle", "", "midlayer.")])
def test_public_layout_checkpoint_loads(pair, tmp_path, producer, prefix, layer):
    """Each producer's layout loads with the target layers it was trained on (EAGLE's: the default)."""
    head = random_head(pair.target, 48, seed=2)
    # speculators and SpecForge save the target's own embedding: shared, not duplicated
    _public_checkpoint(tmp_path, head, prefix, layer, producer, embed=pair.target.model.get_input_embeddings().weight)
    loaded = load_head(tmp_path, pair.target)
    assert loaded.config.draft_vocab_size == 48 and loaded.embed_tokens is None
    assert loaded.config.feature_layers == (() if producer == "eagle" else (1, 1, 2))
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    for name, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)


def test_specforge_layer_ids_name_layer_outputs(pair, tmp_path):
    """SpecForge's eagle_config ids name decoder-layer outputs: the drafter's features are those outputs
    (forward hooks on the trunk's layers), where a loader without the shift feeds each one layer early."""
    target = pair.target
    head = random_head(target, 48, seed=2)
    _public_checkpoint(tmp_path, head, producer="specforge")
    assert json.loads((tmp_path / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 1]
    drafter = Eagle3Drafter(load_head(tmp_path, target), target)
    outputs = {}
    hooks = [layer.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i, layer in enumerate(target.trunk.layers)]
    try:
        _, _, features = target.new_cache_with_features(torch.arange(3, 9), drafter.feature_layers)
    finally:
        for hook in hooks:
            hook.remove()
    expected = torch.cat([outputs[i].reshape(6, -1) for i in (0, 0, 1)], dim=-1)
    torch.testing.assert_close(features, expected)


def test_top_level_layer_ids_win_over_eagle_config_as_in_vllm(pair, tmp_path):
    head = random_head(pair.target, 48, seed=2)
    _public_checkpoint(tmp_path, head, producer="speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}}))
    assert load_head(tmp_path, pair.target).config.feature_layers == (1, 1, 2)


def test_saved_heads_name_their_layers_in_every_readers_convention(pair, tmp_path):
    head = random_head(pair.target, 48, seed=2)
    save_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["feature_layers"] == config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 2]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 1]  # SGLang adds one
    keys = {"feature_layers", "eagle_aux_hidden_state_layer_ids", "eagle_config"}
    for key in keys:  # each reader's key alone gives the same layers
        alone = {k: v for k, v in config.items() if k not in keys - {key}}
        (tmp_path / "config.json").write_text(json.dumps(alone))
        assert load_head(tmp_path, pair.target).config.feature_layers == (1, 1, 2)
    committed = json.loads((committed_head("gemma-3-270m") / "config.json").read_text())
    layers = committed["feature_layers"]
    assert committed["eagle_aux_hidden_state_layer_ids"] == layers
    assert committed["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in layers]


@pytest.mark.parametrize("ids", [[1, 1, 4], [-1, 1, 2], [1, 1, 2.0], "1,1,2"])
def test_layer_ids_outside_the_target_are_refused(pair, tmp_path, ids):
    """The 3-layer target has hidden states 0..3; ids must be integers among them."""
    head = random_head(pair.target, 48, seed=2)
    _public_checkpoint(tmp_path, head, producer="speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": ids}))
    with pytest.raises(ConfigError, match="layer"):
        Eagle3Drafter(load_head(tmp_path, pair.target), pair.target)


def test_a_checkpoints_own_embedding_is_used(pair, tmp_path):
    """An embed_tokens that differs from the target's embeds the draft's tokens (as vLLM does), with a
    warning; a head narrower than the target needs its own and drafts with it."""
    target = pair.target
    head = random_head(target, 48, seed=2)
    own = torch.randn(target.vocab_size, head.config.hidden_size, generator=torch.Generator().manual_seed(9))
    _public_checkpoint(tmp_path / "own", head, embed=own)
    with pytest.warns(UserWarning, match="own embed_tokens"):
        loaded = load_head(tmp_path / "own", target)
    drafter = Eagle3Drafter(loaded, target)
    assert torch.equal(drafter.embed.weight, own)
    shared = Eagle3Drafter(load_head(tmp_path / "own", None).requires_grad_(False), target)
    assert torch.equal(shared.embed.weight, own)  # no target to compare with: kept
    prompt = torch.arange(3, 11)
    d = int(target.head_weight.shape[1])
    narrow = Eagle3Head(Eagle3Config(hidden_size=d // 2, intermediate_size=d, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, vocab_size=target.vocab_size,
                                     draft_vocab_size=48, target_hidden_size=d, feature_layers=(1, 1, 2)))
    narrow.set_vocabulary(torch.arange(48))
    _public_checkpoint(tmp_path / "narrow", narrow, embed=torch.randn(target.vocab_size, d // 2))
    result = generate(target, prompt, drafter=Eagle3Drafter(load_head(tmp_path / "narrow", target), target),
                      max_new_tokens=8)
    assert result.token_ids == generate(target, prompt, max_new_tokens=8).token_ids


def _variant(head: Eagle3Head, **flags) -> Eagle3Head:
    """A head of ``head``'s weights with the variant ``flags`` (and their norms' random weights)."""
    from dataclasses import replace

    variant = Eagle3Head(replace(head.config, **flags))
    variant.load_state_dict(head.state_dict(), strict=False)
    g = torch.Generator().manual_seed(7)
    for name, param in variant.named_parameters():
        if name.startswith(("input_norm", "fc_norm")):
            param.data = 1 + torch.rand(param.shape, generator=g)
    return variant.eval().requires_grad_(False)


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_feature_norms_make_fc_blind_to_each_features_scale(pair, flag):
    """norm_before_fc normalizes the three features together, fc_norm each alone: scaling all of them
    (resp. one) leaves the fused state unchanged, where plain fc scales with them."""
    head = random_head(pair.target, 40, seed=3)
    normed, d = _variant(head, **{flag: True}), head.config.target_hidden_size
    x = torch.randn(2, 3 * d)
    scale = torch.ones(3 * d)
    scale[(slice(None) if flag == "norm_before_fc" else slice(d, 2 * d))] = 5.0
    torch.testing.assert_close(normed.fuse(x * scale), normed.fuse(x), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(head.fuse(x * scale), head.fuse(x), rtol=1e-2)
    with pytest.raises(ConfigError, match="not both"):
        _variant(head, norm_before_fc=True, fc_norm=True)


def test_norm_output_feeds_the_normed_state_forward(pair):
    """With norm_output the root's logits are the same (the LM head reads the normed state either way);
    the next draft step takes the normed state, where EAGLE's head takes the pre-norm one."""
    head = random_head(pair.target, 40, seed=3)
    normed = _variant(head, norm_output=True)
    d = head.config.hidden_size
    embeds, feats, pos = torch.randn(1, 4, d), torch.randn(1, 4, 3 * d), torch.arange(4).view(1, -1)
    caches = Eagle3Cache(), Eagle3Cache()
    plain_root, normed_root = (h.state(embeds, feats, pos, c.attend) for h, c in zip((head, normed), caches, strict=True))
    torch.testing.assert_close(normed.logits(normed_root), head.logits(plain_root))
    step = torch.randn(1, 1, d), torch.tensor([[4]])
    fed_normed = head.state(step[0], head.norm(plain_root[:, -1:]), step[1], caches[0].attend)
    torch.testing.assert_close(normed.logits(normed.state(step[0], normed_root[:, -1:], step[1], caches[1].attend)),
                               head.logits(fed_normed), rtol=1e-4, atol=1e-5)


def test_sliding_window_rows_see_only_the_last_positions(pair):
    """A row of a head with a window of 4 depends on the rows of the last 4 positions only: with rotary
    attention, the last row's state over 10 rows equals its state over those 4 rows alone, fed in one
    call or row by row."""
    head = _variant(random_head(pair.target, 40, seed=3), sliding_window=4)
    d, t = head.config.hidden_size, 10
    embeds, feats = torch.randn(1, t, d), torch.randn(1, t, 3 * d)
    positions = torch.arange(t).view(1, -1)
    full = head.state(embeds, feats, positions, Eagle3Cache(4).attend)[:, -1]
    alone = head.state(embeds[:, -4:], feats[:, -4:], positions[:, -4:], Eagle3Cache().attend)[:, -1]
    torch.testing.assert_close(full, alone, rtol=1e-4, atol=1e-5)
    cache = Eagle3Cache(4)
    for i in range(t):
        row = head.state(embeds[:, i : i + 1], feats[:, i : i + 1], positions[:, i : i + 1], cache.attend)[:, -1]
    torch.testing.assert_close(row, alone, rtol=1e-4, atol=1e-5)
    unwindowed = _variant(head, sliding_window=None)
    assert not torch.allclose(unwindowed.state(embeds, feats, positions, Eagle3Cache().attend)[:, -1], alone, rtol=1e-2)


def test_speculators_variants_load_from_their_checkpoints(pair, tmp_path):
    """A speculators head with its norms (input_norm, fc_norm.*), norm_output and a sliding window loads
    with each of them; a speculators config without norm_before_residual gets vLLM's default (True)."""
    head = random_head(pair.target, 48, seed=2)
    for flags in ({"norm_before_fc": True, "norm_output": True}, {"fc_norm": True, "sliding_window": 8}):
        variant = _variant(head, **flags)
        path = tmp_path / "-".join(flags)
        _public_checkpoint(path, variant, layer="layers.0.", producer="speculators")
        config = json.loads((path / "config.json").read_text())
        config.update(speculators_model_type="eagle3", **{k: v for k, v in flags.items() if k != "sliding_window"})
        if "sliding_window" in flags:
            config["transformer_layer_config"] = {"layer_types": ["sliding_attention"], "sliding_window": 8}
        (path / "config.json").write_text(json.dumps(config))
        loaded = load_head(path, pair.target)
        for key, value in flags.items():
            assert getattr(loaded.config, key) == value
        assert loaded.config.norm_before_residual  # absent from the config: vLLM's default for speculators
        for name, value in variant.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], value)
    assert not Eagle3Config.from_dict(json.loads((tmp_path / "norm_before_fc-norm_output" / "config.json").read_text())
                                      | {"speculators_model_type": None, "norm_before_residual": False}).norm_before_residual


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_scaling_type", "rope_parameters"])
def test_linear_rope_scaling_of_a_public_config_reaches_the_rotary(spelling):
    """Linear scaling by 4 (each spelling the public heads use): position 4 t rotates as position t does
    without scaling. A loader that drops the scaling rotates 4x too fast, and this fails."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 32,
            "rope_theta": 10000.0}
    scaling = {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
               "rope_scaling_type": {"type": "linear", "factor": 4.0},
               "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}[spelling]
    key = "rope_scaling" if spelling == "rope_scaling_type" else spelling
    scaled, plain = Eagle3Head(Eagle3Config.from_dict({**base, key: scaling})), Eagle3Head(Eagle3Config.from_dict(base))
    positions = torch.arange(6).unsqueeze(0)
    like = torch.zeros(1, 6, 16)
    cos_scaled, sin_scaled = scaled.rope(4 * positions, like)
    cos_plain, sin_plain = plain.rope(positions, like)
    assert torch.allclose(cos_scaled, cos_plain, atol=1e-5) and torch.allclose(sin_scaled, sin_plain, atol=1e-5)
    assert not torch.allclose(plain.rope(4 * positions, like)[1], sin_plain, atol=1e-3)  # the check has teeth


def test_head_for_another_vocabulary_is_refused(pair, tmp_path):
    target = pair.target
    head = Eagle3Head(Eagle3Config(hidden_size=int(target.head_weight.shape[1]), intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=target.vocab_size + 5,
                                   draft_vocab_size=16,
                                   feature_layers=(1, 1, 2)))
    head.set_vocabulary(torch.arange(16))
    save_head(head, tmp_path / "other")
    with pytest.raises(ConfigError, match="vocabulary"):
        load_head(tmp_path / "other", target)


def test_missing_or_malformed_head_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for missing in (tmp_path / "no" / "such" / "head", "./rel/missing/head"):
        with pytest.raises(ModelNotFoundError, match="no such directory|not in the local"):
            load_head(missing)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_head(bad)


def test_tied_round_trip_stores_no_lm_head(pair, tmp_path):
    target = pair.target
    head = init_head(tiny_head_config(target, 32, tie_lm_head_to_target=True), target, torch.arange(10, 42))
    save_head(head, tmp_path, dtype=torch.float32, manifest={"steps": 0})
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == 32
    loaded = load_head(tmp_path, target)
    torch.testing.assert_close(loaded.lm_head.weight, target.head_weight[10:42])
    with pytest.raises(ConfigError, match="lm_head"):
        load_head(tmp_path)  # no target to tie the LM head to


def test_unknown_hub_head_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not a local directory"):
        load_head("no-such-org/no-such-eagle3-head")


def _rewrite_weights(path, drop=(), add=None) -> None:
    """Rewrite a checkpoint's model.safetensors without the tensors ``drop``, with ``add`` merged in."""
    from safetensors.torch import load_file, save_file

    state = {k: v for k, v in load_file(path / "model.safetensors").items() if k not in drop}
    save_file({**state, **(add or {})}, path / "model.safetensors")


def test_heads_without_their_vocabulary_maps_load(pair, tmp_path):
    """speculators leaves d2t and t2d out of full-vocabulary heads; t2d is never used at inference."""
    full = random_head(pair.target, seed=4)
    _public_checkpoint(tmp_path / "full", full)
    _rewrite_weights(tmp_path / "full", drop=("d2t", "t2d"))
    loaded = load_head(tmp_path / "full", pair.target)
    assert torch.equal(loaded.draft_to_target, torch.arange(pair.target.vocab_size)) and bool(loaded.t2d.all())
    reduced = random_head(pair.target, 48, seed=5)
    _public_checkpoint(tmp_path / "reduced", reduced)
    _rewrite_weights(tmp_path / "reduced", drop=("t2d",))
    assert torch.equal(load_head(tmp_path / "reduced", pair.target).t2d, reduced.t2d)


def test_heads_that_do_not_fit_are_clear_errors(pair, tmp_path):
    head = random_head(pair.target, 48, seed=6)
    _public_checkpoint(tmp_path, head)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 40}))  # tensors hold 48
    with pytest.raises(ConfigError, match="do not fit its config.json"):
        load_head(tmp_path, pair.target)
    (tmp_path / "config.json").write_text(json.dumps([config]))
    with pytest.raises(ConfigError, match="not an object"):
        load_head(tmp_path, pair.target)
    d = int(pair.target.head_weight.shape[1])
    narrow = Eagle3Head(Eagle3Config(hidden_size=d // 2, intermediate_size=d, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=pair.target.vocab_size, draft_vocab_size=48,
                                     target_hidden_size=d, feature_layers=(1, 1, 2)))
    save_head(narrow, tmp_path / "narrow")
    with pytest.raises(ConfigError, match="token embeddings"):
        load_head(tmp_path / "narrow", pair.target)


def test_only_weight_files_are_read(pair, tmp_path):
    head = random_head(pair.target, 48, seed=7)
    _public_checkpoint(tmp_path, head)
    from safetensors.torch import load_file

    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "training_args.bin").write_bytes(b"a pickled TrainingArguments, not weights")
    loaded = load_head(tmp_path, pair.target)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)
    (tmp_path / "pytorch_model.bin").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="cannot read EAGLE-3 weights"):
        load_head(tmp_path, pair.target)


def test_a_bfloat16_head_keeps_float32_rotary_frequencies(pair, tmp_path):
    head = random_head(pair.target, 48, seed=8)
    _public_checkpoint(tmp_path, head)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    loaded = load_head(tmp_path, pair.target, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    reference = Eagle3Head(Eagle3Config.from_dict({**config, "rope_theta": 500000.0}))
    for name, value in reference.rotary.named_buffers():
        assert getattr(loaded.rotary, name).dtype == torch.float32
        assert torch.equal(getattr(loaded.rotary, name), value), name


class OracleDrafter(Eagle3Drafter):
    """Runs the head (cache, rollback) but proposes the known greedy continuation on a fixed pattern of
    depths, so that drafts are partly accepted and every commit path is exercised."""

    def __init__(self, head, target, prompt_len, greedy):
        super().__init__(head, target)
        self.prompt_len, self.greedy = prompt_len, greedy

    def _choose(self, draft_logits, depth, sampling, generator):
        token, row = super()._choose(draft_logits, depth, sampling, generator)
        index = self._rows + 1 + depth - self.prompt_len  # output index of the token being drafted
        if (self._rows + depth) % 4 != 3 and index < len(self.greedy):
            token = self.greedy[index]
        return token, row


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_sd_with_eagle3_equals_ar(arch):
    pair = make_tiny(arch, seed=4, vocab_size=64)
    target = pair.target
    head = random_head(target, 40, seed=3)
    prompt = torch.randint(3, 64, (11,), generator=torch.Generator().manual_seed(2))
    ar = generate(target, prompt, max_new_tokens=30).token_ids
    for draft_len in (1, 3, 5):
        drafter = OracleDrafter(head, target, prompt.numel(), ar)
        out = generate(target, prompt, drafter=drafter, draft_len=draft_len, max_new_tokens=30)
        assert out.token_ids == ar
        assert sum(out.stats.accepted_per_step) > 0 and out.stats.target_calls < 30
        # the head's cache holds exactly one row per context position, fed with the target's features
        seq = torch.cat([prompt, torch.tensor(ar[:-1])])
        n_rows = len(drafter.cache)
        _, _, feats = target.new_cache_with_features(seq[:n_rows], drafter.feature_layers)
        fresh = Eagle3Cache()
        head.state(target.model.get_input_embeddings()(seq[1 : n_rows + 1].view(1, -1)), feats[None],
                   torch.arange(n_rows).view(1, -1), fresh.attend)
        torch.testing.assert_close(drafter.cache.k, fresh.k, atol=1e-4, rtol=1e-3)
    plain = generate(target, prompt, drafter=Eagle3Drafter(head, target), draft_len=4, max_new_tokens=30)
    assert plain.token_ids == ar
    # a head drafting in bfloat16 for a float32 target (drafting_dtype on CPUs with native bfloat16)
    narrow = in_bfloat16(head)
    assert generate(target, prompt, drafter=Eagle3Drafter(narrow, target), draft_len=4, max_new_tokens=30).token_ids == ar
    for draft_len in (1, 3, 5):
        out = generate(target, prompt, drafter=OracleDrafter(narrow, target, prompt.numel(), ar), draft_len=draft_len,
                       max_new_tokens=30)
        assert out.token_ids == ar and sum(out.stats.accepted_per_step) > 0
    stopping = generate(target, prompt, drafter=Eagle3Drafter(head, target, stop_below=0.1), draft_len=4,
                        max_new_tokens=30)
    assert stopping.token_ids == ar
    lengths = stopping.stats.drafted_per_step[:-4]  # the last steps are cut by the token budget
    assert 4 in lengths and min(lengths) < 4  # the proposals did stop early, and not always


def test_draft_ids_past_the_target_vocabulary_are_never_drafted():
    """A target that uses fewer logit rows (60) than the head's draft vocabulary covers (all 64 ids):
    proposals are the argmax of the draft rows inside the target vocabulary, and SD still equals AR."""
    pair = make_tiny("llama", seed=4, vocab_size=64)
    target = CausalLM(pair.target.model, vocab_size=60)
    head = random_head(pair.target, 64, seed=3)
    drafter = Eagle3Drafter(head, target)
    prompt = torch.randint(3, 60, (9,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, _, features = target.new_cache_with_features(prompt, drafter.feature_layers, rollback=True)
        drafter.start(prompt, features)
        draft = drafter.propose(7, 4, SamplingConfig(), torch.Generator().manual_seed(0))
        state = Eagle3Drafter(head, target)._forward(prompt[1:].tolist() + [7], features, 0)  # the root, anew
    assert draft.logits.shape == (4, 60)
    assert draft.tokens.tolist() == draft.logits.argmax(-1).tolist()
    torch.testing.assert_close(draft.logits[0], head.logits(state[0, 0])[:60])
    ar = generate(target, prompt, max_new_tokens=20).token_ids
    assert generate(target, prompt, drafter=Eagle3Drafter(head, target), draft_len=4, max_new_tokens=20).token_ids == ar


def _exact_t4_marginal(target, prompt, vocab, sampling):
    """P(t4) of plain sampling, enumerating t1..t3."""
    with torch.no_grad():
        grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)
        seqs = torch.cat([prompt.expand(grid.shape[0], -1), grid], dim=1)
        probs = sampling.probs(target.model(seqs).logits[:, -4:])  # (N, 4, V)
        weight = probs[0, 0, grid[:, 0]] * probs[torch.arange(len(grid)), 1, grid[:, 1]] \
            * probs[torch.arange(len(grid)), 2, grid[:, 2]]
        return (weight[:, None] * probs[:, 3]).sum(0)


def test_speculative_sampling_with_eagle3_preserves_target_distribution():
    """Tokens 2-3 (joint) and 4 of SD runs at L = 3 (draft vocabulary 6 of 10) match plain sampling;
    every other run's proposals stop after a draft token of probability below 0.3 (a biased stop
    would bias the pooled counts). The head is ``init_head``'s logit lens over the target's 6 likeliest
    next tokens, close enough to the target that drafts are accepted at every depth (counted), so
    positions 2 and 3 are tested too."""
    vocab = 10
    pair = make_tiny("llama", seed=5, vocab_size=vocab)
    target = pair.target
    sampling = SamplingConfig(1.0)
    prompt = torch.tensor([2, 3, 4, 3, 5, 3])
    with torch.no_grad():
        likeliest = target.model(prompt[None]).logits[0, -1].topk(6).indices
    head = init_head(tiny_head_config(target, 6), target, likeliest, seed=7).eval().requires_grad_(False)
    first_step = torch.zeros(4, dtype=torch.long)  # runs whose first step accepted 0..3 draft tokens
    joint = _exact_joint(target, prompt, vocab, sampling).flatten()
    t4 = _exact_t4_marginal(target, prompt, vocab, sampling)
    counts, counts4 = torch.zeros(vocab * vocab), torch.zeros(vocab)
    drafted = stopped = 0
    for seed in range(3000):
        stop_below = 0.3 if seed % 2 else None
        out = generate(target, prompt, drafter=Eagle3Drafter(head, target, stop_below), draft_len=3,
                       max_new_tokens=5, sampling=sampling, seed=seed)
        counts[out.token_ids[1] * vocab + out.token_ids[2]] += 1
        counts4[out.token_ids[3]] += 1
        drafted += max(out.stats.drafted_per_step, default=0) == 3
        stopped += stop_below is not None and out.stats.drafted_per_step[0] < 3
        first_step[out.stats.accepted_per_step[0]] += 1
    assert drafted > 0 and stopped > 0
    assert first_step[2] >= 50 and first_step[3] >= 50, first_step  # draft positions 2 and 3 are accepted
    for observed, expected in ((counts, joint), (counts4, t4)):
        keep = expected * observed.sum() >= 5
        assert observed[expected == 0].sum() == 0  # no token of zero probability is ever emitted
        pooled = ~keep & (expected > 0)  # rare cells pooled into one (none: no pooled cell)
        obs = torch.cat([observed[keep], observed[pooled].sum().view(1)] if pooled.any() else [observed[keep]])
        wanted = torch.cat([expected[keep], expected[pooled].sum().view(1)] if pooled.any() else [expected[keep]])
        assert chisquare(obs, wanted * observed.sum() / wanted.sum()).pvalue > P_MIN


def test_methods_with_eagle3(pair, tmp_path):
    head = random_head(pair.target, 40, seed=3)
    save_head(head, tmp_path, dtype=torch.float32)
    assert MethodConfig("sd", draft="eagle3").label == "sd+eagle3@L5"
    prompt = list(range(3, 20))
    ar = Decoder(pair, MethodConfig("ar")).generate(prompt, max_new_tokens=16).token_ids
    for config in (MethodConfig("sd", draft="eagle3", draft_head=str(tmp_path)),
                   MethodConfig("sd", draft="eagle3", draft_head=str(tmp_path), draft_stop=0.1),
                   MethodConfig("dropmatch", draft="eagle3", criterion="naive", draft_head=str(tmp_path)),
                   MethodConfig("dropmatch", draft="eagle3", criterion="js+majority", draft_head=str(tmp_path))):
        assert "+eagle3" in config.label
        out = Decoder(pair, config).generate(prompt, max_new_tokens=16)
        assert len(out.token_ids) == 16
        if config.method == "sd":
            assert out.token_ids == ar
    with pytest.raises(ConfigError, match="EAGLE-3 head"):
        Decoder(pair, MethodConfig("sd", draft="eagle3"))  # no committed head for a tiny pair


def test_decoders_draft_in_the_drafting_dtype(pair, tmp_path, monkeypatch):
    """The CLI's decoders and ``eagle3_drafter`` load a head in ``drafting_dtype``: bfloat16 for a float32
    CPU target where the CPU has native bfloat16 GEMMs (patched on and off here), else the target's;
    greedy SD with either still equals AR."""
    import dropmatch.drafters.eagle3 as eagle3

    save_head(random_head(pair.target, 40, seed=3), tmp_path, dtype=torch.float32)
    prompt = list(range(3, 20))
    ar = Decoder(pair, MethodConfig("ar")).generate(prompt, max_new_tokens=16).token_ids
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(eagle3, "bf16_matmul_supported", lambda native=native: native)
        target = CausalLM(pair.target.model)  # heads are cached per target
        assert eagle3.eagle3_drafter(tmp_path, target).head.fc.weight.dtype == dtype
        config = MethodConfig("sd", draft="eagle3", draft_head=str(tmp_path))
        decoder = Decoder(ModelPair(target, pair.draft, pair.tokenizer, pair.name), config)
        assert decoder.drafter.head.fc.weight.dtype == dtype
        assert decoder.generate(prompt, max_new_tokens=16).token_ids == ar
    bf16_target = CausalLM(make_tiny("llama", seed=3, vocab_size=64, layers=3).target.model.to(torch.bfloat16))
    assert eagle3.drafting_dtype(bf16_target) == torch.bfloat16  # a target's own dtype, patched or not


def test_draft_stop_is_named_keyed_and_checked():
    """The dynamic draft length shows in the label and the result key; without it, configurations keep
    the keys they had before the option existed; a value that is not a probability is refused."""
    fixed, stopping = MethodConfig("sd", draft="eagle3"), MethodConfig("sd", draft="eagle3", draft_stop=0.4)
    assert stopping.label == "sd+eagle3[draft_stop=0.4]@L5" and fixed.label == "sd+eagle3@L5"
    assert "draft_stop" not in fixed.to_dict() and stopping.to_dict()["draft_stop"] == 0.4
    assert MethodConfig(**stopping.to_dict()) == stopping and MethodConfig(**fixed.to_dict()) == fixed
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="draft-stop"):
            MethodConfig("sd", draft="eagle3", draft_stop=bad)


def test_draft_stop_reaches_the_model_drafter_and_is_refused_for_ngram(pair):
    """The same option gives the draft model a dynamic draft length (label, key, drafter); n-gram lookup
    has no draft distribution to stop on, so asking it to stop is an error, not a silent no-op."""
    config = MethodConfig("sd", draft_stop=0.5)
    assert config.label == "sd[draft_stop=0.5]@L5" and config.to_dict()["draft_stop"] == 0.5
    assert Decoder(pair, config).drafter.stop_below == 0.5
    assert Decoder(pair, MethodConfig("sd")).drafter.stop_below is None
    with pytest.raises(ConfigError, match="draft-stop"):
        MethodConfig("sd", draft="ngram", draft_stop=0.5)


@pytest.mark.gemma
def test_committed_head_is_lossless_on_gemma(gemma):
    source = committed_head("gemma-3-270m")
    assert source is not None, "the committed head dropmatch/assets/eagle3-gemma-3-270m is missing"
    prompt = gemma.encode("Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:")
    ar = Decoder(gemma, MethodConfig("ar")).generate(prompt, max_new_tokens=32).token_ids
    out = Decoder(gemma, MethodConfig("sd", draft="eagle3", draft_len=5)).generate(prompt, max_new_tokens=32)
    assert out.token_ids == ar
    assert out.stats.tau > 1.1  # the committed head (27 steps) reached 1.33 here
