// The flashmod operator library: every schema is declared here, once. Backends register their
// kernels with TORCH_LIBRARY_IMPL in csrc/<op>/cpu/ and csrc/<op>/cuda/; flashmod/ops.py adds the
// fake (meta) implementations and autograd.
#include <Python.h>
#include <torch/library.h>

// Importing flashmod._C loads this shared library, which runs the registrations below.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(flashmod, m) {
  // q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q's dtype, lse (B, Hq, Nq) fp32.
  // window_right == 0 or is_causal gives causal attention; bottom_right picks the diagonal's
  // alignment (True: flash-attn's, key Nk-1 pairs with query Nq-1; False: SDPA's top-left).
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float? scale=None, "
      "bool is_causal=False, bool bottom_right=True, int window_left=-1, int window_right=-1, "
      "float softcap=0.0) -> (Tensor out, Tensor lse)");
  // Gradients of attention's (out, lse) with respect to (q, k, v), recomputing P from the saved
  // lse (nothing Nq x Nk is stored). grad_lse is the gradient flowing into lse (None: zero).
  // grad_q/grad_k/grad_v take the layouts of q/k/v; for GQA, grad_k/grad_v sum over each kv
  // head's query group. Bitwise reproducible, except the Hopper kernels' fused dQ (long walks,
  // head dims 97-128: dQ added up by atomics), which runs only while
  // torch.use_deterministic_algorithms is off (FLASHMOD_BWD_FUSED_DQ, backward_dispatch.h).
  // compute_grad_mask (an additive float attn_mask only): grad_mask is fp32 contiguous
  // (B, Hq, Nq, Nk), dL/d(score after the mask) at every visible pair and 0 elsewhere (the caller
  // sums it over the mask's broadcast dimensions); otherwise an empty fp32 tensor of shape (0,).
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask=None, float? scale=None, bool is_causal=False, "
      "bool bottom_right=True, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "bool compute_grad_mask=False) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_mask)");
  // attention_backward computed by the chunked reference math (flashmod/reference.py, in Python):
  // the fused kernels' oracle, and what CUDA runs for float32 until it has a fused kernel.
  m.def(
      "attention_backward_reference(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, "
      "Tensor v, Tensor out, Tensor lse, Tensor? attn_mask=None, float? scale=None, "
      "bool is_causal=False, bool bottom_right=True, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, bool compute_grad_mask=False) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_mask)");
  // attention with dropout on the probabilities (training) where attention_dropout (below) does not
  // apply (CPU, fp32, a mask that requires grad, another value head dim): the reference math
  // (flashmod/reference.py, in Python) behind attention's checks, as a CompositeImplicitAutograd
  // op, so autograd and torch.compile see its torch ops while the checks run in the op, where
  // torch.compile does not trace them. v's head dim may differ from q's.
  m.def(
      "attention_dropout_reference(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, "
      "float? scale=None, bool is_causal=False, bool bottom_right=True, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, float dropout_p=0.0) -> (Tensor out, Tensor lse)");
  // attention with dropout fused into the kernels (CUDA: fp16/bf16 on the sm_80 kernels; other
  // devices: the reference math in Python, flashmod/ops.py). Key j of query i of head h is dropped
  // by a counter-based generator from rng_state's two int64 words (flashmod/reference.py:
  // dropout_keep_mask, the definition), so the same rng_state drops the same keys on every device
  // and in the backward, which takes the forward's rng_state and regenerates them.
  m.def(
      "attention_dropout(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float? scale, "
      "bool is_causal, bool bottom_right, int window_left, int window_right, float softcap, "
      "float dropout_p, Tensor rng_state) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_dropout_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask, float? scale, bool is_causal, bool bottom_right, "
      "int window_left, int window_right, float softcap, float dropout_p, Tensor rng_state) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Variable-length (packed) batches, flash-attn's varlen layout: q (total_q, Hq, D), k/v
  // (total_k, Hkv, D); sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1]) (int32, batch + 1
  // entries); max_seqlen_q/k bound the lengths (no device sync). Causal and windows are
  // bottom-right per sequence. -> out (total_q, Hq, D), lse (Hq, total_q) fp32.
  // dropout_p > 0 (training) needs rng_state, as attention_dropout's: sequence b's query i keeps
  // key j as batch row b of a dense attention_dropout call would (its rows and keys counted from
  // the sequence's first), so a sequence's dropout is the dense op's on that sequence's rows.
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float? scale=None, bool is_causal=False, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, float dropout_p=0.0, "
      "Tensor? rng_state=None) -> (Tensor out, Tensor lse)");
  // Gradients of attention_varlen's (out, lse) with respect to (q, k, v), packed like them; a
  // dropout call's backward takes the forward's dropout_p and rng_state.
  m.def(
      "attention_varlen_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float? scale=None, bool is_causal=False, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Decode against a KV cache (flash-attn's with_kvcache layout): q (B, Sq, Hq, D); caches
  // (B_cache, S_cache, Hkv, D), or (pages, page_size, Hkv, D) with block_table (B, max_pages)
  // int32. New k/v (B, S_new, Hkv, D) are written into the caches in place at cache_seqlens
  // (int32 (B)), then row b attends to its first cache_seqlens[b] + S_new keys (bottom-right
  // causal). cache_batch_idx (int32 (B)) maps rows to cache rows. -> out (B, Sq, Hq, D), lse
  // (B, Hq, Sq) fp32.
  m.def(
      "attention_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, "
      "Tensor? v=None, Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, "
      "Tensor? block_table=None, float? scale=None, bool is_causal=False, int window_left=-1, "
      "int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  // Exact merge of partial attention results over disjoint key sets: outs[i] (..., D) with lses[i]
  // (...) fp32 -> out = sum_i exp(lse_i - lse) outs[i], lse = log(sum_i exp(lse_i)); partials with
  // lse -inf (no visible key) contribute nothing, a row with none visible gives (0, -inf).
  m.def("merge_attention(Tensor[] outs, Tensor[] lses) -> (Tensor out, Tensor lse)");
  // Softmax of x along dim (online normalizer); a row of all -inf gives zeros.
  m.def("softmax(Tensor x, int dim) -> Tensor");
  // softmax(scale * a @ b^T + mask, -1) fused: a (B, Ha, M, K), b (B, Hb, N, K) -> (B, Ha, M, N).
  m.def(
      "matmul_softmax(Tensor a, Tensor b, float? scale=None, bool is_causal=False, Tensor? "
      "attn_mask=None) -> Tensor");
}
