"""LM-head numerics: the screened bfloat16 head with an exact argmax, and the K-sample dropout head (with its
W columns in 8 bits for greedy corrections on CPUs, :mod:`.byte_columns`)."""

from ..onednn_linear import bf16_matmul_supported
from .dropout import DropoutHead, check_dropout_args, default_head_dtype, dropout_inputs, keep_scale
from .screened import ScreenedHead

__all__ = ["DropoutHead", "ScreenedHead", "bf16_matmul_supported", "check_dropout_args", "default_head_dtype",
           "dropout_inputs", "keep_scale"]
