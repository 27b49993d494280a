"""flashmod inside HuggingFace transformers models: parity with eager attention on tiny random models.

Every model is built from a config (nothing is downloaded) with hidden size 64 and 2 layers. Each check compares
the same weights under attn_implementation="eager" and flashmod's, so nothing is hard-coded. Tests taking a
``device`` argument run on every available device (tests/conftest.py).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

# Not monkeypatch.setenv: huggingface_hub reads this once, when transformers is imported just below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import flashmod  # noqa: E402  (after importorskip: the whole file needs transformers)
from flashmod import hf as fhf  # noqa: E402

NAME = flashmod.HF_ATTN_IMPLEMENTATION
VOCAB = 128


def _config(family: str):
    """Tiny config of one model family, dropout off (dropout is tested separately)."""
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    if family == "llama":
        return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4)
    if family == "llama_gqa":
        return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    if family == "mistral":  # window smaller than the prompt: the window really cuts
        return transformers.MistralConfig(**common, num_attention_heads=4, num_key_value_heads=2, sliding_window=5)
    if family == "gemma2":  # alternating sliding/full layers, small softcap so that it really bends the scores
        return transformers.Gemma2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=30.0,
        )  # fmt: skip
    if family == "gpt_oss":  # attention sinks (s_aux), alternating sliding/full layers, a tiny MoE
        return transformers.GptOssConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
            num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
    if family == "bert":
        return transformers.BertConfig(
            **common, num_attention_heads=4, max_position_embeddings=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
    raise ValueError(family)


CAUSAL = ["llama", "llama_gqa", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss", "gpt2"]
FAMILIES = CAUSAL + ["bert"]


def _build(family: str, device: str, dtype: torch.dtype = torch.float32, impl: str = "eager"):
    torch.manual_seed(0)
    config = _config(family)
    auto = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=impl)
    if family == "gpt_oss":  # sinks of the size of the scores, so that they move the answers
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(
                config.num_attention_heads, generator=torch.Generator().manual_seed(4)
            )
    return model.to(device=device, dtype=dtype).eval()


def _inputs(family: str, device: str, batch: int = 3, seqlen: int = 12):
    """Token ids and a padding mask: left padding for decoders, right padding for BERT, one unpadded row."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    pads = [4, 0, 7][:batch]
    for row, n in enumerate(pads):
        if n:
            if family == "bert":
                mask[row, seqlen - n :] = 0
            else:
                mask[row, :n] = 0
    return ids.to(device), mask.to(device)


def _output(model, family, ids, mask, **kwargs):
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    return out.last_hidden_state if family == "bert" else out.logits


def _max_err(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    return (a.float() - b.float())[valid].abs().max().item()


# --------------------------------------------------------------------------------------------- registration


def test_name_is_not_taken_for_a_flash_or_sdpa_kernel():
    from transformers.utils.generic import is_flash_attention_requested

    assert "flash" not in NAME and "sdpa" not in NAME and "/" not in NAME
    assert not is_flash_attention_requested(requested_attention_implementation=NAME)


def test_registered_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert fhf.is_registered()
    assert AttentionInterface._global_mapping[NAME] is fhf.hf_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is sdpa_mask


def test_import_does_not_import_transformers_and_registers_later():
    code = (
        "import sys, flashmod\n"
        "assert 'transformers' not in sys.modules, 'import flashmod imported transformers'\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        f"assert {NAME!r} in AttentionInterface._global_mapping\n"
        f"assert {NAME!r} in AttentionMaskInterface._global_mapping\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_output_attentions_found_after_an_earlier_call():
    """The backend finds transformers' output collector even when it was first asked before that module
    loaded (a fresh process: the lookup is per process); caching that miss once dropped GPT-2's weights."""
    code = (
        "import sys, torch, transformers, flashmod\n"
        "assert 'transformers.utils.output_capturing' not in sys.modules\n"
        "assert not flashmod.hf._attentions_requested(torch.nn.Linear(1, 1), {})\n"
        "torch.manual_seed(0)\n"
        "config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4)\n"
        "model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation='eager').eval()\n"
        "ids = torch.randint(0, 128, (2, 9))\n"
        "ref = model(input_ids=ids, output_attentions=True).attentions\n"
        "with flashmod.patched(model):\n"
        "    ours = model(input_ids=ids, output_attentions=True).attentions\n"
        "assert len(ours) == len(ref) == 2, (len(ours), len(ref))\n"
        "for a, b in zip(ours, ref):\n"
        "    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_import_without_transformers():
    code = "import sys\nsys.modules['transformers'] = None\nimport flashmod\nassert not flashmod.hf.register()\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_import_after_transformers_registers():
    code = (
        "import sys, transformers.modeling_utils, flashmod\n"
        "from transformers import AttentionInterface\n"
        f"assert {NAME!r} in AttentionInterface._global_mapping\n"
        "assert 'transformers.masking_utils' not in sys.modules\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        f"assert {NAME!r} in AttentionMaskInterface._global_mapping\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_from_pretrained_with_attn_implementation(tmp_path):
    model = _build("qwen2", "cpu")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    assert loaded.config._attn_implementation == NAME
    ids, mask = _inputs("qwen2", "cpu")
    ref = _output(model, "qwen2", ids, mask)
    valid = mask.bool()
    assert _max_err(_output(loaded, "qwen2", ids, mask), ref, valid) <= 1e-4 * ref[valid].abs().max().item()


def test_patch_container_with_hf_model_and_multihead_attention():
    container = torch.nn.ModuleDict({"lm": _build("gpt2", "cpu"), "mha": torch.nn.MultiheadAttention(16, 2)})
    with flashmod.patched(container):
        assert container["lm"].config._attn_implementation == NAME
        assert isinstance(container["mha"], flashmod.FlashMultiheadAttention)
    assert container["lm"].config._attn_implementation == "eager"
    assert type(container["mha"]) is torch.nn.MultiheadAttention


def test_entry_points_route_to_flashmod(monkeypatch):
    calls = []
    real = fhf.attention_bhsd

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fhf, "attention_bhsd", counting)
    ids, mask = _inputs("llama", "cpu")
    model = _build("llama", "cpu", impl=NAME)  # from_config(..., attn_implementation=NAME)
    model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2
    model = _build("llama", "cpu")
    model.set_attn_implementation(NAME)
    model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 4
    model.set_attn_implementation("eager")
    model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 4


def test_patch_unpatch_and_context_manager():
    model = _build("llama", "cpu")
    assert flashmod.patch(model) is model
    assert model.config._attn_implementation == NAME
    with pytest.raises(RuntimeError, match="already patched"):
        flashmod.patch(model)
    flashmod.unpatch(model)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="not patched"):
        flashmod.unpatch(model)
    with flashmod.patched(model) as m:
        assert m.config._attn_implementation == NAME
    assert model.config._attn_implementation == "eager"


def test_unsupported_features_raise_clearly():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(
        ValueError, match=r"s_aux \(attention sinks\) must be a tensor of one logit per query head, \(2,\)"
    ):
        fhf.hf_attention_forward(module, q, q, q, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="4-D"):
        fhf.hf_attention_forward(module, q[0], q[0], q[0], None)
    with pytest.raises(RuntimeError, match="broadcastable"):
        fhf.hf_attention_forward(module, q, q, q, torch.ones(1, 1, 3, 5, dtype=torch.bool)[..., :2])


# ---------------------------------------------------------------------------------- the function, directly


def test_no_mask_semantics_match_sdpa_integration(device):
    """Without a mask: causal top-left for several queries, everything for one query (HF sdpa's contract)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    torch.manual_seed(0)
    for seqlen_q, seqlen_k in [(6, 6), (1, 9), (6, 9)]:
        q = torch.randn(2, 4, seqlen_q, 16, device=device)
        k, v = torch.randn(2, 2, seqlen_k, 16, device=device), torch.randn(2, 2, seqlen_k, 16, device=device)
        ours, _ = fhf.hf_attention_forward(module, q, k, v, None, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_no_mask_sliding_window_matches_transformers_mask_functions(device, causal):
    """A direct call without a mask applies ``sliding_window`` exactly as transformers' mask functions do."""
    from transformers import masking_utils as mu

    window = 3
    module = torch.nn.Module()
    module.is_causal = causal
    q, k, v = (torch.randn(2, 4, 9, 16, device=device) for _ in range(3))
    pattern = (mu.sliding_window_causal_mask_function if causal else mu.sliding_window_bidirectional_mask_function)(
        window
    )
    mask = mu.sdpa_mask(2, 9, 9, mask_function=pattern, allow_is_causal_skip=False, device=device)
    ours, _ = fhf.hf_attention_forward(module, q, k, v, None, sliding_window=window)
    ref, _ = fhf.hf_attention_forward(module, q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- model parity


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_fp32_match_eager(family, device):
    model = _build(family, device)
    ids, mask = _inputs(family, device)
    ref = _output(model, family, ids, mask)
    with flashmod.patched(model):
        ours = _output(model, family, ids, mask)
    valid = mask.bool()  # padded positions are garbage in every implementation
    assert _max_err(ours, ref, valid) <= 1e-4 * ref[valid].abs().max().item()


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2", "gpt_oss", "gpt2", "bert"])
def test_output_attentions_match_eager(family, device):
    model = _build(family, device)
    ids, mask = _inputs(family, device)
    ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    with flashmod.patched(model):
        ours = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(ref) == 2
    rows = mask.bool()[:, None, :, None]  # query rows of real tokens
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a * rows, b * rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_bf16_error_within_3x_eager(family, device):
    """flash-attn's rule: our bf16 error vs fp32 eager is at most 3x bf16 eager's error."""
    model32 = _build(family, device)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    ids, mask = _inputs(family, device)
    valid = mask.bool()
    ref32 = _output(model32, family, ids, mask)
    eager_err = _max_err(_output(model16, family, ids, mask), ref32, valid)
    with flashmod.patched(model16):
        ours_err = _max_err(_output(model16, family, ids, mask), ref32, valid)
    assert ours_err <= 3 * eager_err + 1e-6, (ours_err, eager_err)


@pytest.mark.parametrize("family", CAUSAL)
def test_greedy_generate_matches_eager(family, device):
    """32+ new tokens with a KV cache (prefill with padding mask, then one-query decode steps)."""
    model = _build(family, device)
    ids, mask = _inputs(family, device)
    kwargs = {"attention_mask": mask, "max_new_tokens": 34, "min_new_tokens": 34, "do_sample": False, "pad_token_id": 0}
    ref = model.generate(ids, **kwargs)
    with flashmod.patched(model):
        ours = model.generate(ids, **kwargs)
    assert ours.shape == ref.shape == (ids.shape[0], ids.shape[1] + 34)
    assert torch.equal(ours, ref)


def test_generate_static_cache_matches_eager(device):
    """StaticCache prefill is where transformers drops the mask with more keys than queries (top-left case)."""
    model = _build("llama_gqa", device)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2)).to(device)
    kwargs = {
        "max_new_tokens": 32,
        "min_new_tokens": 32,
        "do_sample": False,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    with flashmod.patched(model):
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(ours, ref)


def _grads(model, family, ids, mask, call=None):
    model.zero_grad(set_to_none=True)
    out = _output(model if call is None else call, family, ids, mask)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device)
    loss = (out * weight)[mask.bool()].sum()  # padded positions excluded, as a real loss would
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_match_eager(family, device):
    model = _build(family, device).train()
    ids, mask = _inputs(family, device)
    ref = _grads(model, family, ids, mask)
    with flashmod.patched(model):
        ours = _grads(model, family, ids, mask)
    assert ours.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].abs().max().item()
        assert (ours[name] - ref[name]).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_dropout_in_training_only():
    config = _config("llama")
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    ids, mask = _inputs("llama", "cpu")
    model.eval()
    a = model(input_ids=ids, attention_mask=mask).logits
    b = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    model.train()
    c = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(c).all() and not torch.allclose(a, c)
    c.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # A training step under torch.compile(fullgraph=True) too: dropout runs the reference as an op
    # whose checks Dynamo does not trace (traced, their message closures had stopped it).
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    d = compiled(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(d).all() and not torch.allclose(a, d)
    model.zero_grad()
    d.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------------ compile / export


def test_compile_fullgraph_forward_and_training_step():
    """No graph break from flashmod: fullgraph=True would raise. aot_eager traces forward and backward."""
    model = _build("llama_gqa", "cpu").train()
    ids, mask = _inputs("llama_gqa", "cpu")
    ref = _grads(model, "llama_gqa", ids, mask)
    ref_logits = _output(model, "llama_gqa", ids, mask)
    flashmod.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    logits = _output(compiled, "llama_gqa", ids, mask)
    valid = mask.bool()
    assert _max_err(logits, ref_logits, valid) <= 1e-4 * ref_logits[valid].abs().max().item()
    ours = _grads(model, "llama_gqa", ids, mask, call=compiled)
    for name in ref:
        assert (ours[name] - ref[name]).abs().max().item() <= 1e-4 * ref[name].abs().max().item() + 1e-7, name


def test_torch_export_of_patched_model():
    model = _build("llama_gqa", "cpu")
    ids, mask = _inputs("llama_gqa", "cpu")
    flashmod.patch(model)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    wrapper = Wrapper(model)
    exported = torch.export.export(wrapper, (ids, mask), strict=False)
    assert any("flashmod.attention" in str(node.target) for node in exported.graph.nodes)
    valid = mask.bool()
    expected = wrapper(ids, mask)
    assert _max_err(exported.module()(ids, mask), expected, valid) <= 1e-5 * expected[valid].abs().max().item()


def test_backward_fake_matches_real_for_hf_layouts():
    """HF's q/k/v are (B, S, H, D) buffers viewed as (B, H, S, D): the backward's fake must report the strides the
    real op returns, or inductor's stride asserts fail in a compiled training step."""
    q = torch.randn(2, 16, 4, 8).transpose(1, 2)
    k = torch.randn(2, 16, 2, 8).transpose(1, 2)
    out, lse = flashmod.attention_op(q, k, k, None, None, True, False)
    args = (torch.randn_like(out), None, q, k, k, out, lse, None, None, True, False, -1, -1, 0.0)
    torch.library.opcheck(torch.ops.flashmod.attention_backward.default, args, test_utils=("test_faketensor",))
