"""flashmod: FlashAttention for PyTorch — one attention op on CPU and CUDA.

``torch.ops.flashmod.attention(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left,
window_right, softcap) -> (out, lse)`` is the operator; the functions below are its front doors.
"""

from .functional import attention, flash_attn_func
from .modules import FlashAttention
from .ops import attention_op
from .reference import attention_reference
from .softmax_ops import matmul_softmax, softmax  # noqa: F401  (issue 5: softmax ops)

__all__ = ["FlashAttention", "attention", "attention_op", "attention_reference", "flash_attn_func"]
__version__ = "0.1.0"
