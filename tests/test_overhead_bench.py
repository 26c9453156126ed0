"""The head-overhead benchmark's read floor: the bytes it charges a head path are the bytes that path reads."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dropmatch.benchmarks.dropmatch_overhead import measure_overhead, read_floor
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


def test_overhead_table_charges_floors_to_dropmatch_rows_only():
    pair = load_pair("tiny")
    prompt = pair.encode("The quick brown fox")
    table = measure_overhead(pair, [prompt], max_new_tokens=24, repeats=1, p_drops=(0.05,), criteria=("naive",))
    standard, dropmatch = table.iloc[0], table.iloc[-1]
    assert pd.isna(standard["streaming read (ms)"])
    assert dropmatch["positions with heads / step"] > 0
    assert dropmatch["MB read / position"] > 0
    assert dropmatch["read floor (% of verify step)"] > 0
