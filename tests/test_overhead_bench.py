"""The head-overhead benchmark's read floor: the bytes it charges a head path are the bytes that path reads."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dropmatch.benchmarks.dropmatch_overhead import (
    WHOLE_DRAFT,
    add_floors,
    measure_overhead,
    pooled_overhead,
    read_floor,
)
from dropmatch.heads.byte_columns import BYTE_ROWWISE, byte_bags_supported
from dropmatch.heads.dropout import DropoutHead
from dropmatch.heads.int8_gemm import int8_gemm_supported
from dropmatch.models import load_pair
from dropmatch.onednn_linear import onednn_linear_supported


def test_sparse_floor_is_the_mean_of_the_rows_the_embedding_bags_read():
    weight = torch.randn(512, 64)
    head = DropoutHead(weight, k=5, p_drop=0.05, compute_dtype=torch.float32, sparse=True)
    masks = head.draw_masks(4000, torch.Generator().manual_seed(0))  # (positions, K, d)
    rows_read = (~masks).sum(dim=(1, 2)).float()  # one embedding-bag row per dropped column of each head
    row_mb = weight.shape[0] * 4 / 1e6
    megabytes, read_ms = read_floor(head)
    assert megabytes == pytest.approx(float(rows_read.mean()) * row_mb, rel=0.03)
    assert read_ms > 0


@pytest.mark.skipif(not onednn_linear_supported(), reason="exact rows need oneDNN's float32 GEMM")
def test_exact_rows_floor_is_one_read_of_the_weight():
    weight = torch.randn(512, 64)
    head = DropoutHead(weight, k=5, p_drop=0.3)
    assert head.exact_rows
    assert read_floor(head, torch.float32)[0] == weight.numel() * 4 / 1e6
    assert read_floor(head, torch.bfloat16)[0] == weight.numel() * 2 / 1e6  # certified bfloat16 rows


@pytest.mark.skipif(not (byte_bags_supported() and int8_gemm_supported()), reason="needs fbgemm and oneDNN's int8 GEMM")
def test_int8_gemm_floor_is_one_int8_read_of_the_weight():
    weight = torch.randn(512, 64)
    head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.float32, sparse=True, sparse_dtype=BYTE_ROWWISE)
    assert head.corrections_by_gemm
    assert read_floor(head)[0] == weight.numel() / 1e6


def test_dense_heads_have_no_read_of_their_own():
    head = DropoutHead(torch.randn(512, 64), k=5, p_drop=0.3, sparse=False, exact_rows=False)
    assert read_floor(head) == (0.0, 0.0)


def test_fused_heads_are_named_and_charged_no_read():
    """A rows head's greedy heads ride in the verification GEMM: the table names them so and charges them no read
    of their own (their cost is in the measured time); with float32 clean logits they are the rows they were."""
    from dropmatch.benchmarks.dropmatch_overhead import head_path
    from dropmatch.rules import RelaxedVerification
    from dropmatch.rules.dropmatch import DropMatch

    head = DropoutHead(torch.randn(512, 64), k=5, p_drop=0.3, compute_dtype=torch.bfloat16)
    if not (head.exact_rows and head.rows_dtype == torch.bfloat16):
        pytest.skip("needs oneDNN with native bfloat16")
    fused, rows = DropMatch(head, "naive"), DropMatch(head, "naive", screened_clean_logits=False)
    assert head_path(fused) == "bfloat16 rows fused" and head_path(rows) == "bfloat16 rows"
    table = pd.DataFrame([{"head + rule / step (ms)": 10.0, "positions with heads / step": 0.0, "verify step (ms)": 50.0},
                          {"head + rule / step (ms)": 12.0, "positions with heads / step": 0.8, "verify step (ms)": 50.0},
                          {"head + rule / step (ms)": 20.0, "positions with heads / step": 0.8, "verify step (ms)": 50.0}])
    floors = add_floors(table, {WHOLE_DRAFT: None, "fused": RelaxedVerification(fused), "rows": RelaxedVerification(rows)})
    assert floors["MB read / position"].tolist()[1:] == [0.0, 512 * 64 * 2 / 1e6]
    assert floors["head + rule / position (ms)"].tolist()[1:] == [2.5, 12.5]


def test_overhead_table_charges_floors_to_dropmatch_rows_only():
    pair = load_pair("tiny")
    prompt = pair.encode("The quick brown fox")
    table = measure_overhead(pair, [prompt], max_new_tokens=24, repeats=2, p_drops=(0.05,), criteria=("naive",))
    standard, dropmatch = table.iloc[0], table.iloc[-1]
    assert pd.isna(standard["streaming read (ms)"])
    assert dropmatch["positions with heads / step"] > 0
    assert dropmatch["MB read / position"] > 0
    assert dropmatch["read floor (% of verify step)"] > 0
    assert len(dropmatch["per pass (%)"]) == 2  # one per pass, each against the step timed beside it


def test_pooled_overhead_divides_each_pass_by_its_own_step():
    """2 and 4 ms extra a step over steps timed at 100 and 50 ms: 2 % and 8 % a pass, 6 / 150 = 4 % pooled."""
    overhead, per_pass = pooled_overhead([12.0, 14.0], [10.0, 10.0], [100.0, 50.0])
    assert per_pass == pytest.approx((2.0, 8.0)) and overhead == pytest.approx(4.0)
