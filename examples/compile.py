"""torch.compile and torch.export with flashmod inside a HuggingFace model.

    python examples/compile.py [--device cuda|cpu] [--backend inductor|aot_eager]

``flashmod.attention`` is a custom op with a fake (meta) implementation and a registered autograd formula,
so dynamo keeps it as one node: ``fullgraph=True`` compiles a patched model's forward and its training step
without graph breaks, and ``torch.export`` captures it (the op appears as ``torch.ops.flashmod.attention``).

On a small CPU machine inductor's first compilations (forward, then forward + backward) take minutes;
``--backend aot_eager`` checks the same full-graph capture in seconds.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device)
    ids = torch.randint(0, config.vocab_size, (2, 64), device=device)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # left padding: the mask is a real 4-D bool tensor inside the graph
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        eager_logits = model(input_ids=ids, attention_mask=mask).logits

    flashmod.patch(model)
    compiled = torch.compile(model, backend=args.backend, fullgraph=True)  # raises on any graph break

    # Forward.
    start = time.perf_counter()
    with torch.no_grad():
        logits = compiled(input_ids=ids, attention_mask=mask).logits
    print(f"compiled forward (first call, includes compilation): {time.perf_counter() - start:.1f} s")
    diff = (logits - eager_logits)[mask.bool()].abs().max().item()
    print(f"compiled flashmod vs eager attention: max |logits diff| = {diff:.2e}")

    # Training steps, compiled forward + backward.
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = compiled(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        print(f"compiled train step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f} s)")

    # torch.export: the attention is one custom-op node in the exported graph.
    model.eval()

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    wrapper = LogitsOnly(model)
    exported = torch.export.export(wrapper, (ids, mask), strict=False)
    nodes = [n for n in exported.graph.nodes if "flashmod" in str(n.target)]
    print(f"torch.export: {len(nodes)} flashmod nodes, e.g. {nodes[0].target}")
    with torch.no_grad():
        diff = (exported.module()(ids, mask) - wrapper(ids, mask))[mask.bool()].abs().max().item()
    print(f"exported vs eager-mode module: max |logits diff| = {diff:.2e}")


if __name__ == "__main__":
    main()
