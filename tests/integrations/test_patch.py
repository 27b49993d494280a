"""flashmod.patch on plain PyTorch models: nn.MultiheadAttention -> FlashMultiheadAttention, against torch.

Tests taking a ``device`` argument run on every available device (tests/conftest.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import flashmod
from flashmod import FlashMultiheadAttention

E, H, B, L, S = 32, 4, 3, 7, 9


def _masks(kind: str, batch: int, seqlen_q: int, seqlen_k: int, device: str):
    """(attn_mask, key_padding_mask) in torch's convention: bool True = masked out, float = additive."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([seqlen_k, seqlen_k - 3, 2][:batch])
    pad = torch.arange(seqlen_k)[None, :] >= lengths[:, None]  # True = padding
    banned = torch.rand(seqlen_q, seqlen_k, generator=gen) < 0.3
    banned[:, 0] = False  # every query keeps one key
    if kind == "none":
        return None, None
    if kind == "bool_kpm":
        return None, pad.to(device)
    if kind == "float_kpm":
        return None, torch.zeros(batch, seqlen_k).masked_fill(pad, float("-inf")).to(device)
    if kind == "bool_both":
        return banned.to(device), pad.to(device)
    if kind == "float_attn":
        return torch.randn(seqlen_q, seqlen_k, generator=gen).to(device), None
    if kind == "float_3d_bool_kpm":  # per (batch, head) additive mask with a bool padding mask
        m = torch.randn(batch * H, seqlen_q, seqlen_k, generator=gen).masked_fill(banned, float("-inf"))
        return m.to(device), pad.to(device)
    raise ValueError(kind)


def _pair(device: str, **kwargs):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kwargs).to(device)
    ours = FlashMultiheadAttention.from_torch(copy.deepcopy(ref))
    return ref, ours


def _qkv(device: str, batch_first: bool, self_attn: bool, kdim: int = E, vdim: int = E, unbatched: bool = False):
    gen = torch.Generator().manual_seed(3)

    def make(n, d):
        shape = (n, d) if unbatched else ((B, n, d) if batch_first else (n, B, d))
        return torch.randn(shape, generator=gen).to(device).requires_grad_()

    q = make(L if not self_attn else S, E)
    if self_attn:
        return q, q, q
    return q, make(S, kdim), make(S, vdim)


@pytest.mark.parametrize(
    ("batch_first", "self_attn", "masks", "need_weights", "average"),
    [
        (True, True, "none", False, True),
        (False, True, "bool_kpm", True, True),
        (True, False, "float_kpm", True, False),
        (False, False, "bool_both", False, True),
        (True, True, "float_attn", True, True),
        (True, False, "float_3d_bool_kpm", True, False),
    ],
)
def test_mha_matches_torch(device, batch_first, self_attn, masks, need_weights, average):
    ref, ours = _pair(device, batch_first=batch_first)
    q, k, v = _qkv(device, batch_first, self_attn)
    seqlen_q = q.shape[1] if batch_first else q.shape[0]
    attn_mask, kpm = _masks(masks, B, seqlen_q, S, device)
    kwargs = {
        "key_padding_mask": kpm,
        "attn_mask": attn_mask,
        "need_weights": need_weights,
        "average_attn_weights": average,
    }
    out_ref, w_ref = ref(q, k, v, **kwargs)
    out, w = ours(q, k, v, **kwargs)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    if need_weights:
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    else:
        assert w is None and w_ref is None
    # gradients w.r.t. inputs and the (shared-layout) parameters
    grad = torch.randn_like(out_ref)
    g_ref = torch.autograd.grad(out_ref, [q, k, v, *ref.parameters()], grad, allow_unused=True)
    g = torch.autograd.grad(out, [q, k, v, *ours.parameters()], grad, allow_unused=True)
    for a, b in zip(g, g_ref):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("add_bias_kv", "add_zero_attn", "kdim", "bias"),
    itertools.product([False, True], [False, True], [None, 24], [True, False]),
)
def test_mha_options_match_torch(device, add_bias_kv, add_zero_attn, kdim, bias):
    ref, ours = _pair(
        device, batch_first=True, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=kdim, bias=bias
    )
    q, k, v = _qkv(device, True, False, kdim or E, kdim or E)
    attn_mask, kpm = _masks("bool_both", B, L, S, device)
    out_ref, w_ref = ref(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)
    out, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_mha_causal_and_unbatched(device):
    ref, ours = _pair(device, batch_first=True)
    q, k, v = _qkv(device, True, True)
    causal = nn.Transformer.generate_square_subsequent_mask(S, device=device)
    for need_weights in (False, True):
        out_ref, _ = ref(q, k, v, attn_mask=causal, is_causal=True, need_weights=need_weights)
        out, _ = ours(q, k, v, attn_mask=causal, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    q1, k1, v1 = _qkv(device, True, False, unbatched=True)
    out_ref, w_ref = ref(q1, k1, v1, key_padding_mask=torch.arange(S, device=device) >= S - 2)
    out, w = ours(q1, k1, v1, key_padding_mask=torch.arange(S, device=device) >= S - 2)
    assert out.shape == out_ref.shape == (L, E) and w.shape == w_ref.shape == (L, S)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_mha_bad_calls_raise():
    _, ours = _pair("cpu", batch_first=True)
    q, k, v = _qkv("cpu", True, True)
    with pytest.raises(RuntimeError, match="is_causal"):
        ours(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(q, k, v, key_padding_mask=torch.zeros(B + 1, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch \\* num_heads"):
        ours(q, k, v, attn_mask=torch.zeros(2, S, S, dtype=torch.bool))
    with pytest.raises(TypeError):
        FlashMultiheadAttention.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="all be batched .* got 2-D, 3-D and 3-D"):
        ours(q[0], k, v)
    with pytest.raises(ValueError, match=f"key must have {E} features .* got {E + 1}"):
        ours(q, torch.randn(B, S, E + 1), v)
    with pytest.raises(TypeError, match=r"outs\[1\] must be a tensor, got NoneType"):
        flashmod.merge_attention([q, None], [q[..., 0], q[..., 0]])
    # Integer masks (1 = pad, as older torch code wrote them) would be added to the scores: torch refuses them.
    for name in ("key_padding_mask", "attn_mask"):
        shape = (B, S) if name == "key_padding_mask" else (S, S)
        for dtype in (torch.uint8, torch.int64):
            with pytest.raises(TypeError, match=f"{name} must be bool .* or floating point .* got {dtype}"):
                ours(q, k, v, **{name: torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize(("add_bias_kv", "add_zero_attn"), [(True, False), (False, True)])
def test_mha_causal_hint_keeps_the_appended_key_visible(device, add_bias_kv, add_zero_attn):
    """With add_bias_kv / add_zero_attn the padded causal mask shows the appended key to every query
    (torch's answer with weights or a padding mask); the kernel's own diagonal would hide it."""
    ref, ours = _pair(device, batch_first=True, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    q, k, v = _qkv(device, True, True)
    causal = nn.Transformer.generate_square_subsequent_mask(S, device=device)
    out_ref, _ = ref(q, k, v, attn_mask=causal, need_weights=True)  # torch's masked answer, no hint
    for need_weights in (False, True):
        out, _ = ours(q, k, v, attn_mask=causal, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


def test_patch_leaves_parametrized_attention_alone():
    """A parametrized weight is computed from its parameter on every access: a swapped module would keep one
    computed copy (training would stop reaching the parameter), so patch leaves such modules as they are."""
    model = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=True))
    nn.utils.parametrize.register_parametrization(model[0], "in_proj_weight", _Scaled())
    flashmod.patch(model)
    assert not isinstance(model[0], FlashMultiheadAttention)
    flashmod.unpatch(model)
    assert nn.utils.parametrize.is_parametrized(model[0], "in_proj_weight")


class _Scaled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_mha_constructor_and_state_dict_compatible():
    torch.manual_seed(0)
    ours = FlashMultiheadAttention(E, H, dropout=0.1, batch_first=True, add_bias_kv=True)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True, add_bias_kv=True)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    ref.load_state_dict(ours.state_dict())


def test_mha_dropout_only_in_training():
    ref, ours = _pair("cpu", batch_first=True, dropout=0.5)
    q, k, v = _qkv("cpu", True, True)
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v)[0], rtol=1e-5, atol=1e-5)
    ours.train()
    out, w = ours(q, k, v, need_weights=True, average_attn_weights=False)
    assert torch.isfinite(out).all()
    zeros = (w == 0).float().mean().item()
    assert 0.3 < zeros < 0.7  # about half of the probabilities dropped
    out2, _ = ours(q, k, v, need_weights=False)
    assert not torch.allclose(out, out2)


# ------------------------------------------------------------------------------------------ whole models


def _encoder(device: str, norm_first: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).to(device)


@pytest.mark.parametrize("grad", [False, True])
def test_transformer_encoder_eval_uses_flashmod_and_matches(device, grad, monkeypatch):
    """Eval mode without grad is where torch takes its fused / nested-tensor fast paths."""
    calls = []
    forward = FlashMultiheadAttention.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FlashMultiheadAttention, "forward", counting)
    model = _encoder(device).eval()
    x = torch.randn(B, S, E, device=device)
    _, pad = _masks("bool_kpm", B, S, S, device)
    assert torch.backends.mha.get_fastpath_enabled()
    with torch.set_grad_enabled(grad):
        ref = model(x, src_key_padding_mask=pad)
        with flashmod.patched(model):
            assert not model.use_nested_tensor
            out = model(x, src_key_padding_mask=pad)
            causal = nn.Transformer.generate_square_subsequent_mask(S, device=device)
            out_causal = model(x, mask=causal, is_causal=True)
        assert model.use_nested_tensor  # restored
        ref_causal = model(x, mask=causal, is_causal=True)
    assert len(calls) == 4  # 2 layers x 2 calls: flashmod really ran
    valid = ~pad  # torch's nested path returns 0 at padded positions
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_causal, ref_causal, rtol=1e-5, atol=1e-5)


def test_transformer_encoder_training_step_matches(device):
    model = _encoder(device, norm_first=True).train()
    x = torch.randn(B, S, E, device=device)
    _, pad = _masks("bool_kpm", B, S, S, device)
    target = torch.randn(B, S, E, device=device)

    def grads():
        model.zero_grad(set_to_none=True)
        out = model(x, src_key_padding_mask=pad)
        ((out - target)[~pad] ** 2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads()
    with flashmod.patched(model):
        ours = grads()
        names = {n for n, _ in model.named_parameters()}
    assert names == set(ref)  # same parameter names while patched
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6)


def test_patch_shares_parameters_and_unpatch_restores():
    model = _encoder("cpu")
    originals = [layer.self_attn for layer in model.layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flashmod.patch(model)
    assert all(isinstance(layer.self_attn, FlashMultiheadAttention) for layer in model.layers)
    assert model.layers[0].self_attn.in_proj_weight is originals[0].in_proj_weight
    model.train()
    x = torch.randn(B, S, E)
    model(x).sum().backward()
    optimizer.step()  # the optimizer built before patching updates the shared parameters
    flashmod.unpatch(model)
    assert [layer.self_attn for layer in model.layers] == originals
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("self_attn.in_proj_weight" in n for n in changed)


def test_patch_decoder_and_bare_mha_and_mixed_container():
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 64, dropout=0.0, batch_first=True), 1).eval()
    tgt, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    ref = decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    with flashmod.patched(decoder):
        assert isinstance(decoder.layers[0].multihead_attn, FlashMultiheadAttention)
        out = decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    bare = nn.MultiheadAttention(E, H)
    swapped = flashmod.patch(bare)
    assert isinstance(swapped, FlashMultiheadAttention) and swapped.in_proj_weight is bare.in_proj_weight

    class Custom(nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    holder = nn.Sequential(Custom(E, H))
    with pytest.warns(UserWarning, match="found no"):
        flashmod.patch(holder)
    assert type(holder[0]) is Custom  # subclasses with their own forward are left alone


def test_transformer_encoder_bf16_error_within_3x_torch(device):
    """flash-attn's rule: our bf16 error vs fp32 torch is at most 3x torch's own bf16 error."""
    model32 = _encoder(device).eval()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    x = torch.randn(B, S, E, device=device)
    _, pad = _masks("bool_kpm", B, S, S, device)
    valid = ~pad
    with torch.no_grad():
        ref = model32(x, src_key_padding_mask=pad)
        torch_err = (model16(x.bfloat16(), src_key_padding_mask=pad).float() - ref)[valid].abs().max().item()
        with flashmod.patched(model16):
            ours = model16(x.bfloat16(), src_key_padding_mask=pad)
    ours_err = (ours.float() - ref)[valid].abs().max().item()
    assert ours_err <= 3 * torch_err + 1e-6, (ours_err, torch_err)


def test_patched_encoder_compiles_fullgraph():
    model = _encoder("cpu").train()
    x = torch.randn(B, S, E)
    _, pad = _masks("bool_kpm", B, S, S, "cpu")
    flashmod.patch(model)
    expected = model(x, src_key_padding_mask=pad)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # raises on a graph break
    out = compiled(x, src_key_padding_mask=pad)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out[~pad].sum().backward()
    assert model.layers[0].self_attn.in_proj_weight.grad is not None
