"""The analyses behind the notebooks, on the tiny pair."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from scipy.spatial.distance import jensenshannon  # noqa: E402

from dropmatch import analysis, experiments  # noqa: E402
from dropmatch.engine import generate  # noqa: E402
from dropmatch.figures import save_figure  # noqa: E402
from dropmatch.methods import MethodConfig, dropout_head  # noqa: E402
from dropmatch.paths import data_dir  # noqa: E402
from dropmatch.reproduce import PRESETS, notebooks, parse_value  # noqa: E402
from dropmatch.tasks import load_task  # noqa: E402

from .conftest import random_prompt  # noqa: E402

needs_data = pytest.mark.skipif(not (data_dir() / "gsm8k").is_dir(), reason="benchmark data directory not found")


def test_dropout_path(tiny):
    prompt = random_prompt(0).tolist()
    greedy = generate(tiny.target, prompt, max_new_tokens=20).token_ids
    assert analysis.dropout_path(tiny.target, prompt, 0.0, seed=3, max_new_tokens=20) == greedy
    a = analysis.dropout_path(tiny.target, prompt, 0.3, seed=1, max_new_tokens=20)
    assert a == analysis.dropout_path(tiny.target, prompt, 0.3, seed=1, max_new_tokens=20)
    others = {tuple(analysis.dropout_path(tiny.target, prompt, 0.3, seed=s, max_new_tokens=20)) for s in range(2, 6)}
    assert len(others | {tuple(a)}) > 1


def test_head_agreement_and_probe(tiny):
    prompt = random_prompt(1).tolist()
    answer = generate(tiny.target, prompt, max_new_tokens=16).token_ids
    none = analysis.head_agreement(tiny, prompt, answer, k=5, p_drop=0.0)
    assert (none["majority_count"] == 5).all()
    noisy = analysis.head_agreement(tiny, prompt, answer, k=5, p_drop=0.5)
    assert noisy["majority_count"].min() >= 1 and noisy["majority_count"].mean() < 5
    assert ((noisy["majority_prob"] >= 0) & (noisy["majority_prob"] <= 1)).all()
    rows = analysis.acceptance_probe(tiny, prompt, answer, [0.0, 0.3], ["naive", "js+majority"])
    for row in rows:
        assert row["acceptance_rate"] >= row["exact_match_rate"]
        if row["p_drop"] == 0.0:
            assert row["acceptance_rate"] == row["exact_match_rate"]
    assert any(r["acceptance_rate"] > r["exact_match_rate"] for r in rows if r["p_drop"] == 0.3)


def test_js_radii_match_an_independent_computation_and_split_like_head_agreement(tiny):
    """Table 3's quantities: the heads' centroid, the radius and the draft's JS, checked against scipy's
    Jensen-Shannon distance on heads computed directly as W (h * m / (1 - p)) with the same masks."""
    prompt = random_prompt(1).tolist()
    answer = generate(tiny.target, prompt, max_new_tokens=16).token_ids
    hidden, logits, draft_logits = analysis.teacher_forced(tiny, prompt, answer)
    calm = analysis.js_radii_at(tiny.target, hidden, logits, draft_logits, k=5, p_drop=0.0, seed=3)
    assert calm["agree"].all() and np.abs(calm["js_heads"]).max() < 1e-6  # no dropout: every head is the target
    assert calm["js_draft"].min() > 1e-4  # the tiny draft is not the target
    itself = analysis.js_radii_at(tiny.target, hidden, logits, logits, k=5, p_drop=0.0, seed=3)
    assert np.abs(itself["js_draft"]).max() < 1e-6
    for p in (0.1, 0.5):
        radii = analysis.js_radii_at(tiny.target, hidden, logits, draft_logits, k=5, p_drop=p, seed=3, chunk=4)
        split = analysis.head_agreement_at(tiny.target, hidden, logits, k=5, p_drop=p, seed=3, chunk=4)
        assert (radii["agree"] == (split["majority_count"] == 5)).all()
        head = dropout_head(tiny.target, 5, p)
        masks = head.draw_masks(4, torch.Generator().manual_seed(3))  # the first chunk's masks
        direct = torch.softmax(head.exact_logits(hidden[:4], masks).double(), -1).numpy()  # (4, K, V)
        draft = torch.softmax(draft_logits[:4].double(), -1).numpy()
        for j in range(4):
            centre = np.exp(np.log(direct[j]).mean(0))
            centre /= centre.sum()  # softmax of the mean logits
            radius = max(jensenshannon(direct[j, i], centre) ** 2 for i in range(5))
            assert radii["js_heads"][j] == pytest.approx(radius, rel=1e-3, abs=1e-7)
            assert radii["js_draft"][j] == pytest.approx(jensenshannon(draft[j], centre) ** 2, rel=1e-3, abs=1e-7)
        assert radii["js_heads"].min() > 0 and radii["js_heads"].max() <= np.log(2)


def test_equal_noise_scaling(tiny):
    assert analysis.equal_noise_p_drop(0.3, 8192, 8192) == pytest.approx(0.3)
    assert analysis.equal_noise_p_drop(0.3, 8192, 640) == pytest.approx(0.03241, abs=1e-4)
    assert analysis.equal_noise_p_drop(0.3, 640, 8192) > 0.3
    hidden = torch.randn(8, 64)
    noise = [analysis.relative_logit_noise(tiny.target, hidden, p) for p in (0.0, 0.05, 0.3)]
    assert noise[0] == 0.0 and noise[0] < noise[1] < noise[2]


def test_shared_prefix_and_embeddings():
    agreement = analysis.shared_prefix([[1, 2, 3, 4], [1, 2, 9, 4], [7, 2, 3, 4]])
    assert agreement[0, 1] == 0.5 and agreement[0, 2] == 0.0 and np.allclose(np.diag(agreement), 1)
    emb = analysis.sentence_embeddings(["The cat sat on the mat.", "The cat sat on the mat.", "Stock prices fell."])
    sim = analysis.pairwise_cosine(emb)
    assert emb.shape == (3, 384)
    assert sim[0, 1] == pytest.approx(1.0, abs=1e-5) and sim[0, 2] < 0.5


@needs_data
def test_experiments_on_tiny(tiny, tmp_path):
    configs = {"SD": MethodConfig("sd"), "DM": MethodConfig("dropmatch")}
    table = experiments.run_methods(tiny, "klue_nli", configs, tmp_path, n_prompts=2, max_new_tokens=8,
                                    baseline="SD", progress=False)
    assert list(table.name) == ["SD", "DM"] and table.speedup.iloc[0] == 1.0
    assert {"tau", "exact_match_rate", "verify_ms_per_step", "draft_acceptance"} <= set(table.columns)
    examples = load_task("humaneval", limit=2)
    paths = experiments.dropout_paths(tiny, examples, [0.0, 0.2], k=2, max_new_tokens=6, results_dir=tmp_path,
                                      progress=False)
    assert len(paths) == 2 * 2 * 2
    again = experiments.dropout_paths(tiny, examples, [0.0, 0.2], k=2, max_new_tokens=6, results_dir=tmp_path,
                                      progress=False)
    assert again == paths  # resumed from the file, nothing recomputed differently
    greedy = dict(zip([e.id for e in examples], experiments.greedy_answers(tiny, examples, 6, tmp_path), strict=True))
    scores = experiments.head_scores(paths, greedy, "pass@1")
    assert scores[scores.p_drop == 0.0].exact_match.eq(1.0).all()  # p = 0 paths are the greedy output
    sweep = experiments.acceptance_sweep(tiny, examples, [0.0, 0.3], ["naive"], 6, tmp_path)
    assert (sweep.acceptance_rate >= sweep.exact_match_rate).all()


def test_save_figure_writes_png_pdf_and_manifest(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    paths = save_figure(fig, "demo", {"k": 5, "seed": 0}, tmp_path)
    assert [p.suffix for p in paths] == [".png", ".pdf", ".json"] and all(p.exists() for p in paths)
    manifest = json.loads(paths[2].read_text())
    assert manifest["parameters"] == {"k": 5, "seed": 0}
    assert {"packages", "device", "git_revision", "threads"} <= set(manifest["environment"])


def test_reproduce_presets_and_notebooks():
    names = [nb.name for nb in notebooks()]
    assert names == sorted(names) and len(names) >= 7
    assert set(PRESETS) == {"ci", "smoke", "default", "paper", "paper-qwen"}
    assert parse_value("[0.1, 0.3]") == [0.1, 0.3] and parse_value("gemma-3-270m") == "gemma-3-270m"
