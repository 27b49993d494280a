"""Packed-sequence training through the fmod_attention backend: a batch packed into one row (position_ids
restarting at 0, or transformers' varlen kwargs) gives the padded batch's loss and gradients, and runs
flash_attn_varlen_func rather than a (N x N) mask."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import flashmod  # noqa: E402
from flashmod import hf as fhf  # noqa: E402

VOCAB = 128


def _model(family: str, device: str):
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    if family == "llama_gqa":
        config = transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2)
    elif family == "mistral":  # a window shorter than the longest sequence
        config = transformers.MistralConfig(**common, num_attention_heads=4, num_key_value_heads=2, sliding_window=5)
    elif family == "gpt_oss":  # attention sinks on every layer
        config = transformers.GptOssConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
            num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=flashmod.HF_ATTN_IMPLEMENTATION)
    if family == "gpt_oss":
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(4, generator=torch.Generator().manual_seed(4))
    return model.to(device).train()


def _padded_and_packed(lengths, device):
    seqs = [torch.randint(0, VOCAB, (n,), device=device) for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)], labels[b, : len(s)] = s, 1, s
    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    # As DataCollatorWithFlattening: each sequence's first label is -100, so no prediction crosses a boundary.
    packed_labels = torch.cat([torch.cat([torch.tensor([-100], device=device), s[1:]]) for s in seqs])[None]
    return (ids, mask, labels), (packed_ids, position_ids, packed_labels)


def _loss_and_grads(model, **inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama_gqa", "mistral", "gpt_oss"])
@pytest.mark.parametrize("varlen_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_training_matches_padded_batch(device, family, varlen_kwargs):
    model = _model(family, device)
    lengths = [9, 17, 3, 1]
    (ids, mask, labels), (packed_ids, position_ids, packed_labels) = _padded_and_packed(lengths, device)
    loss_padded, grads_padded = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)

    extra = {}
    if varlen_kwargs:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    with mock.patch.object(fhf, "flash_attn_varlen_func", wraps=fhf.flash_attn_varlen_func) as varlen:
        loss_packed, grads_packed = _loss_and_grads(
            model, input_ids=packed_ids, position_ids=position_ids, labels=packed_labels, **extra
        )
    assert varlen.call_count == model.config.num_hidden_layers, "the packed batch did not run varlen attention"
    assert torch.allclose(loss_packed, loss_padded, rtol=1e-5, atol=1e-6), (loss_packed.item(), loss_padded.item())
    for name, g in grads_padded.items():
        assert torch.allclose(grads_packed[name], g, rtol=1e-4, atol=1e-6), name


def test_unpacked_position_ids_keep_the_dense_path(device):
    """One sequence (positions never restart) and ordinary padded batches do not take the varlen path."""
    model = _model("llama_gqa", device).eval()
    ids = torch.randint(0, VOCAB, (1, 12), device=device)
    with mock.patch.object(fhf, "flash_attn_varlen_func", wraps=fhf.flash_attn_varlen_func) as varlen:
        model(input_ids=ids, position_ids=torch.arange(12, device=device)[None])
        model(input_ids=ids.expand(2, -1), attention_mask=torch.ones(2, 12, dtype=torch.long, device=device))
    assert varlen.call_count == 0


def _with_attention_dropout(model, p: float):
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p
    return model


@pytest.mark.parametrize("family", ["llama_gqa", "mistral", "gpt_oss"])
@pytest.mark.parametrize("varlen_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_training_with_dropout_keeps_sequences_apart(device, family, varlen_kwargs):
    """Under attention dropout each packed sequence attends to itself alone (flash_attn_varlen_func with
    dropout_p; until session 40 the packed row ran as one causal sequence, every sequence seeing the ones
    before it; sessions 40-42 ran each sequence through the dense op). With p so
    small that no probability is dropped (threshold 0), the loss and gradients are the padded batch's; with
    p = 0.3 and the same seed, the last sequence's logits do not change when the first one's tokens do."""
    lengths = [9, 17, 3, 5]
    (ids, mask, labels), (packed_ids, position_ids, packed_labels) = _padded_and_packed(lengths, device)
    extra = {"position_ids": position_ids}
    if varlen_kwargs:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        extra |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}

    model = _model(family, device)
    loss_padded, grads_padded = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    _with_attention_dropout(model, 1e-9)
    loss_packed, grads_packed = _loss_and_grads(model, input_ids=packed_ids, labels=packed_labels, **extra)
    assert torch.allclose(loss_packed, loss_padded, rtol=1e-5, atol=1e-6), (loss_packed.item(), loss_padded.item())
    for name, g in grads_padded.items():
        assert torch.allclose(grads_packed[name], g, rtol=1e-4, atol=1e-6), name

    _with_attention_dropout(model, 0.3)
    other_first = packed_ids.clone()
    other_first[0, : lengths[0]] = (other_first[0, : lengths[0]] + 1) % VOCAB
    logits = []
    for tokens in (packed_ids, other_first):
        torch.manual_seed(7)
        logits.append(model(input_ids=tokens, **extra).logits[0, -lengths[-1] :])
    # (Close, not equal: gpt-oss's experts run the packed row's tokens together, in shapes that change with
    # the routing.)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5, msg="the last sequence saw the first")
    torch.manual_seed(8)
    assert not torch.equal(model(input_ids=packed_ids, **extra).logits[0, -lengths[-1] :], logits[0]), "no dropout"
