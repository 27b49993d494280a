"""flashmod as a HuggingFace transformers attention backend: parity and timing against eager and sdpa.

    python examples/hf_generate.py [--device cuda|cpu] [--dtype float32|bfloat16]

Builds a small random-weight Llama (GQA) from a config (nothing is downloaded), runs the same weights with
attn_implementation="eager", "sdpa" and flashmod's ("fmod_attention", via ``flashmod.patch``), and prints the
largest logit difference on a left-padded batch, whether greedy ``generate()`` gives the same tokens, and
the time of a prefill forward and of a generation.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import flashmod


def default_device() -> str:
    """CUDA when there is a GPU and flashmod was built with its CUDA kernel, else CPU."""
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("flashmod::attention", "CUDA")
    return "cuda" if torch.cuda.is_available() and has_cuda_kernel else "cpu"


def timed(fn, device: torch.device, repeats: int = 3) -> tuple[object, float]:
    """Result of fn() and its best wall time in ms over `repeats` runs (after one warm-up)."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return result, best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: 4 query heads per kv head, no repeat_kv with flashmod
        max_position_embeddings=1024,
    )
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device, dtype).eval()
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    fmod = flashmod.patch(copy.deepcopy(eager))  # same as set_attn_implementation(flashmod.HF_ATTN_IMPLEMENTATION)
    models = {"eager": eager, "sdpa": sdpa, flashmod.HF_ATTN_IMPLEMENTATION: fmod}

    # A left-padded batch: the rows are 128, 96, 64 and 120 tokens long.
    batch = 4
    ids = torch.randint(0, config.vocab_size, (batch, args.prompt_len), device=device)
    mask = torch.ones_like(ids)
    for row, length in enumerate(
        [args.prompt_len, args.prompt_len * 3 // 4, args.prompt_len // 2, args.prompt_len - 8]
    ):
        mask[row, : args.prompt_len - length] = 0
    valid = mask.bool()
    gen_kwargs = {
        "attention_mask": mask,
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }

    print(f"device={device} dtype={dtype} batch={batch} prompt={args.prompt_len} new_tokens={args.new_tokens}")
    print(f"flashmod registered as attn_implementation={flashmod.HF_ATTN_IMPLEMENTATION!r}")
    logits, tokens, times = {}, {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            logits[name], prefill_ms = timed(lambda m=model: m(input_ids=ids, attention_mask=mask).logits, device)
            tokens[name], generate_ms = timed(lambda m=model: m.generate(ids, **gen_kwargs), device)
            times[name] = (prefill_ms, generate_ms)

    print("\nparity (logits of real tokens; padded positions are garbage in every implementation):")
    for name in ("eager", "sdpa"):
        diff = (logits[flashmod.HF_ATTN_IMPLEMENTATION] - logits[name]).float()[valid].abs().max().item()
        same = torch.equal(tokens[flashmod.HF_ATTN_IMPLEMENTATION], tokens[name])
        print(f"  vs {name:5s}: max |logits diff| = {diff:.3e}   same {args.new_tokens} generated tokens: {same}")
    print("\ntiming (best of 3 runs after a warm-up):")
    for name, (prefill_ms, generate_ms) in times.items():
        print(f"  {name:15s} prefill {prefill_ms:8.1f} ms   generate {generate_ms:8.1f} ms")


if __name__ == "__main__":
    main()
