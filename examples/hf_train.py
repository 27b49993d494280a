"""Train a small HuggingFace causal LM with flashmod's attention and with torch SDPA, side by side.

    python examples/hf_train.py                       # CPU (or CUDA when present): defaults, ~1-2 min on 2 cores
    python examples/hf_train.py --device cuda --dtype bfloat16 --steps 500 --seq-len 1024 --batch 16

A tiny Llama (GQA, random init, built from a config: nothing is downloaded) learns the bytes of this
repository's README. The same initial weights and the same batches train two copies, one with
attn_implementation="sdpa" and one with flashmod's ("fmod_attention", ``flashmod.HF_ATTN_IMPLEMENTATION``);
their steps alternate, so machine noise hits both alike. Prints both loss curves' agreement and each
backend's training throughput (tokens/s, median over steps after a warm-up), writes a JSON (and, with
matplotlib, a plot) under benchmarks/results/, and exits non-zero when the smoothed losses differ by more
than --tolerance at any point.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import flashmod

REPO = Path(__file__).resolve().parent.parent


def default_device() -> str:
    """CUDA when there is a GPU and flashmod was built with its CUDA kernel, else CPU."""
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("flashmod::attention", "CUDA")
    return "cuda" if torch.cuda.is_available() and has_cuda_kernel else "cpu"


def corpus(device: torch.device) -> torch.Tensor:
    """The README's bytes (shipped with the repository) as token ids 0..255."""
    data = (REPO / "README.md").read_bytes()
    return torch.tensor(list(data), dtype=torch.long, device=device)


def batches(tokens: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches of random windows of seq_len tokens, the same for every backend."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len, (steps, batch), generator=gen)
    offsets = torch.arange(seq_len)
    return [tokens[(s[:, None] + offsets).to(tokens.device)] for s in starts]


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def smooth(values: list[float], width: int) -> list[float]:
    """Running mean over the last `width` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameters and activations (default: float32 on CPU, bfloat16 on CUDA)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (head_dim = hidden / 4 heads)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the tokens/s median")
    parser.add_argument("--smooth", type=int, default=20, help="running-mean width for the loss comparison")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="largest allowed |difference| of the smoothed losses (nats)")  # fmt: skip
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--tag", default=None, help="file name stem (default: <date>-<device>-hf-train)")
    parser.add_argument("--no-save", action="store_true", help="print only: no JSON, no plot")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    warmup = args.warmup_steps if args.warmup_steps is not None else min(10, args.steps // 4)

    torch.manual_seed(args.seed)
    heads = 4
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,  # GQA 4/2: flashmod takes it without repeat_kv
        max_position_embeddings=max(1024, args.seq_len),
        attention_dropout=0.0,
        tie_word_embeddings=True,
    )
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    models = {"sdpa": base, flashmod.HF_ATTN_IMPLEMENTATION: copy.deepcopy(base)}
    models[flashmod.HF_ATTN_IMPLEMENTATION].set_attn_implementation(flashmod.HF_ATTN_IMPLEMENTATION)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for name, m in models.items()}
    for m in models.values():
        m.train()

    data = batches(corpus(device), args.steps, args.batch, args.seq_len, args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"device={device} dtype={dtype} params={n_params / 1e6:.2f}M layers={args.layers} hidden={args.hidden} "
        f"heads={heads}/{heads // 2} batch={args.batch} seq_len={args.seq_len} steps={args.steps} "
        f"threads={torch.get_num_threads() if device.type == 'cpu' else '-'}"
    )
    losses: dict[str, list[float]] = {name: [] for name in models}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for step, ids in enumerate(data):
        for name, model in models.items():  # alternating: noise hits both backends alike
            sync(device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            sync(device)
            seconds[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  " + "  ".join(f"{n} loss {losses[n][-1]:.4f}" for n in models), flush=True)

    tokens_per_step = args.batch * args.seq_len
    tokens_per_s = {n: tokens_per_step / statistics.median(s[warmup:] or s) for n, s in seconds.items()}
    fmod = flashmod.HF_ATTN_IMPLEMENTATION
    smoothed = {n: smooth(v, args.smooth) for n, v in losses.items()}
    max_diff = max(abs(a - b) for a, b in zip(smoothed[fmod], smoothed["sdpa"]))
    print(f"\nloss: first {losses['sdpa'][0]:.3f}; last (mean of {args.smooth}) "
          + "  ".join(f"{n} {smoothed[n][-1]:.4f}" for n in models)
          + f"; max |smoothed difference| {max_diff:.4f} (tolerance {args.tolerance})")  # fmt: skip
    print("tokens/s (median step after warm-up, forward + backward + AdamW): "
          + "  ".join(f"{n} {t:,.0f}" for n, t in tokens_per_s.items())
          + f"  -> flashmod / sdpa = {tokens_per_s[fmod] / tokens_per_s['sdpa']:.2f}x")  # fmt: skip

    if not args.no_save:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{datetime.date.today().isoformat()}-{device.type}-hf-train"
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        payload = {
            "device": device_name,
            "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "config": {k: vars(args)[k] for k in ("steps", "batch", "seq_len", "hidden", "layers", "lr", "seed")},
            "params": n_params,
            "tokens_per_s": tokens_per_s,
            "max_abs_smoothed_loss_diff": max_diff,
            "losses": losses,
            "step_seconds": seconds,
        }
        (out_dir / f"{tag}.json").write_text(json.dumps(payload, indent=1))
        print(f"wrote {out_dir / f'{tag}.json'}")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
            for (n, color), style in zip({"sdpa": "tab:blue", fmod: "tab:red"}.items(), ("-", "--")):
                ax.plot(losses[n], color=color, alpha=0.25, linewidth=0.8)
                ax.plot(smoothed[n], color=color, linestyle=style, label=f"{n} ({tokens_per_s[n]:,.0f} tokens/s)")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (nats/byte)")
            ax.set_title(f"tiny Llama, {device_name}, {str(dtype).removeprefix('torch.')}", fontsize=9)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / f"{tag}.png", dpi=120)
            print(f"wrote {out_dir / f'{tag}.png'}")
    if max_diff > args.tolerance:
        raise SystemExit(f"the loss curves differ by {max_diff:.4f} > {args.tolerance}")


if __name__ == "__main__":
    main()
