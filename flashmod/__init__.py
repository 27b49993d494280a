"""flashmod: FlashAttention for PyTorch — one attention op on CPU and CUDA.

``torch.ops.flashmod.attention(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left,
window_right, softcap) -> (out, lse)`` is the operator; the functions below are its front doors.

Inside real models:

* HuggingFace transformers: ``attn_implementation=flashmod.HF_ATTN_IMPLEMENTATION`` (``"fmod_attention"``) in
  ``from_pretrained`` / ``from_config`` / ``set_attn_implementation``, registered on import (see
  :mod:`flashmod.hf`; transformers itself is not imported by ``import flashmod``);
* :func:`patch` / :func:`unpatch` / :func:`patched`: switch a whole model over, HF models and
  ``nn.MultiheadAttention`` alike (see :mod:`flashmod.patch`);
* :class:`FlashAttention`: the attention core for hand-written blocks, and
  :class:`FlashMultiheadAttention`: a drop-in ``nn.MultiheadAttention`` (both in :mod:`flashmod.modules`).
"""

from . import hf as _hf
from .functional import attention, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .hf import HF_ATTN_IMPLEMENTATION
from .merge_ops import merge_attention
from .modules import FlashAttention, FlashMultiheadAttention
from .ops import attention_op
from .patch import patch, patched, unpatch
from .reference import attention_reference
from .serve_ops import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .softmax_ops import matmul_softmax, softmax

_hf._install()

__all__ = [
    "HF_ATTN_IMPLEMENTATION",
    "FlashAttention",
    "FlashMultiheadAttention",
    "attention",
    "attention_op",
    "attention_reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "matmul_softmax",
    "merge_attention",
    "patch",
    "softmax",
    "patched",
    "unpatch",
]
__version__ = "0.1.0"
