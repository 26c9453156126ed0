"""LM-head numerics: the screened bfloat16 head with an exact argmax, and the K-sample dropout head (with its
W columns in 8 bits for greedy corrections on CPUs, :mod:`.byte_columns`, or all of W in int8 for oneDNN's
int8 GEMM where many columns drop, :mod:`.int8_gemm`)."""

from ..onednn_linear import bf16_matmul_supported
from .dropout import DropoutHead, check_dropout_args, default_head_dtype, dropout_inputs, keep_scale
from .screened import ScreenedHead

__all__ = ["DropoutHead", "ScreenedHead", "bf16_matmul_supported", "check_dropout_args", "default_head_dtype",
           "dropout_inputs", "keep_scale"]
