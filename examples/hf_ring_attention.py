"""A HuggingFace decoder whose attention runs ring-parallel across processes (context parallelism).

    python examples/hf_ring_attention.py [--world-size 2] [--seqlen 96] [--backend gloo|nccl]

Builds a small random-weight Llama (GQA) from a config (nothing is downloaded) and computes the causal
LM loss and its gradients twice on the same tokens: in one process with attn_implementation="sdpa",
and split across ``--world-size`` processes, each holding a zigzag slice of the sequence
(``flashmod.distributed.shard_sequence``) and running attention through
``flashmod.distributed.ring_attention`` registered as transformers attention "fmod_ring". Rotary
embeddings see each token's global position (``position_ids``). Prints both losses and the largest
gradient difference; they agree to rounding.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

from flashmod.distributed import ring_attention, shard_sequence

RING_ATTENTION = "fmod_ring"


def ring_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, ring_seqlen=None, **_
):
    """transformers AttentionInterface function: causal attention over the whole (sharded) sequence.
    transformers' mask describes only this rank's slice and is not used: the ring applies causality
    over global positions. ``ring_seqlen`` (the whole sequence's length, passed to the model's forward,
    which hands it on to every layer's attention) spares each layer's call a host synchronization."""
    if dropout:
        raise NotImplementedError("fmod_ring: attention dropout is not supported")
    out = ring_attention(
        query, key, value, causal=True, scale=scaling, softcap=float(softcap or 0.0), seqlen=ring_seqlen
    )
    return out.transpose(1, 2).contiguous(), None


def tiny_llama(seed: int) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)
    try:
        model = tiny_llama(seed=0).to(device)
        torch.manual_seed(1)
        ids = torch.randint(0, 128, (2, args.seqlen), device=device)
        # Token t predicts token t + 1; the last one predicts nothing.
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        count = (targets != -100).sum()

        # One process, the whole sequence.
        single = copy.deepcopy(model)
        loss_single = lm_loss_sum(single(input_ids=ids).logits, targets) / count
        loss_single.backward()

        # Ring: this rank's zigzag slice of tokens, positions and targets.
        AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
        ring = copy.deepcopy(model)
        ring.set_attn_implementation(RING_ATTENTION)
        positions = torch.arange(args.seqlen, device=device).expand(2, -1)
        local = {name: shard_sequence(t, 1, rank, world_size, causal=True) for name, t in
                 (("ids", ids), ("positions", positions), ("targets", targets))}  # fmt: skip
        logits = ring(input_ids=local["ids"], position_ids=local["positions"], ring_seqlen=args.seqlen).logits
        local_sum = lm_loss_sum(logits, local["targets"])
        (local_sum / count).backward()
        loss_ring = local_sum.detach().clone()
        dist.all_reduce(loss_ring)
        loss_ring /= count
        worst = 0.0
        for p_single, p_ring in zip(single.parameters(), ring.parameters()):
            grad = p_ring.grad.clone()
            dist.all_reduce(grad)  # each rank holds its tokens' share of every parameter's gradient
            worst = max(worst, (grad - p_single.grad).abs().max().item())
        if rank == 0:
            results.put((loss_single.item(), loss_ring.item(), worst))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="processes forming the ring")
    parser.add_argument("--seqlen", type=int, default=96, help="tokens per sequence (split across the ranks)")
    parser.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl"], help="gloo (CPU) or nccl (one GPU a rank)"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        worker, args=(args.world_size, port, args, results), nprocs=args.world_size, start_method="spawn"
    )
    loss_single, loss_ring, worst = results.get()
    print(f"causal LM loss, one process (sdpa):       {loss_single:.6f}")
    print(f"causal LM loss, {args.world_size} ranks (flashmod ring):  {loss_ring:.6f}")
    print(f"largest parameter-gradient difference:   {worst:.2e}")
    if abs(loss_single - loss_ring) > 1e-4 * max(1.0, abs(loss_single)) or worst > 1e-4:
        raise SystemExit("ring-parallel result differs from the single-process one")


if __name__ == "__main__":
    main()
