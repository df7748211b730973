"""A small GPT trained with DistributedDataParallel on synthetic tokens, with rankwatch attached.

    rankwatch torchrun --standalone --nproc-per-node 4 examples/ddp_gpt.py --steps 100
    rankwatch analyze runs/ddp_gpt-<time>

Runs on CPU (gloo) or CUDA (NCCL), whichever the machine has. The lines marked ``# rankwatch`` are all that
rankwatch needs; under plain torchrun, set RANKWATCH_RUN_DIR to the run directory.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _faults import Faults
from rankwatch import collector, recovery  # rankwatch


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.mask: torch.Tensor
        # a buffer, not a parameter: DDP broadcasts it from rank 0 before every forward (broadcast_buffers=True)
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len)).view(1, 1, seq_len, seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_head: int, n_layer: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, seq_len, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


Batch = tuple[torch.Tensor, torch.Tensor]


class TokenStream:
    """Synthetic next-token data: each rank its own stream (as a DistributedSampler would give), from a generator
    of its own, so the global RNG sees only the model's initialization and dropout. Resumable like torchdata's
    StatefulDataLoader: `state_dict` is its position and its generator's state."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device) -> None:
        self.args, self.device, self.position = args, device, 0
        self.g = torch.Generator().manual_seed(args.seed * 1000 + rank)

    def __next__(self) -> Batch:
        length = self.args.seq_len
        if self.args.min_seq_len:  # variable-length batches, as an unpacked loader gives: each rank draws its own
            length = int(torch.randint(self.args.min_seq_len, self.args.seq_len + 1, (1,), generator=self.g))
        tokens = torch.randint(self.args.vocab, (self.args.batch_size, length + 1), generator=self.g)
        self.position += 1
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "generator": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.g.set_state(state["generator"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--min-seq-len", type=int, default=0,
                        help="draw each batch's length in [this, seq-len] (0: every batch seq-len long)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the time per step is measured")
    parser.add_argument("--per-rank-seed", action="store_true", help="seed each rank with seed + rank")
    parser.add_argument("--fingerprint-every", type=int, default=10,
                        help="fingerprint the state every N steps (0: never)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="resume from the run's newest usable checkpoint")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints while training goes on")
    args = parser.parse_args()

    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    rw = collector.attach()  # rankwatch
    torch.manual_seed(args.seed + rank if args.per_rank_seed else args.seed)
    faults = Faults.from_env(rank)

    gpt = GPT(args.vocab, args.d_model, args.n_head, args.n_layer, args.seq_len, args.dropout).to(device)
    model = DDP(gpt, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    faults.watch(optimizer)
    data = TokenStream(args, rank, device)

    numerics = {k: v for k, v in vars(args).items()
                if k not in ("steps", "warmup", "save_every", "resume", "async_save")}
    global_batch = args.batch_size * dist.get_world_size()  # samples a step: every replica's batch
    ckpt = recovery.Checkpointer(rw, model, optimizer, lr_scheduler=None, grad_scaler=None, data=data,  # rankwatch
                                 rng={"torch": "per_rank" if args.per_rank_seed else "replicated"},  # rankwatch
                                 every=args.save_every, config=numerics,  # rankwatch
                                 global_batch=global_batch,  # rankwatch
                                 position=lambda: data.position * global_batch,  # rankwatch
                                 async_save=args.async_save)  # rankwatch
    first = ckpt.resume() if args.resume else 0  # rankwatch

    started = time.perf_counter()
    for step in range(first, args.steps):
        if step == first + args.warmup:
            started = time.perf_counter()
        with rw.step(step) as s:  # rankwatch
            faults.inject(step, data)
            x, y = next(data)
            s.tokens = x.numel()  # rankwatch (optional): the batch's work, where batches differ in it
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if args.fingerprint_every and step % args.fingerprint_every == 0:  # rankwatch
            rw.maybe_fingerprint(step, model, optimizer, data_position=data.position * global_batch,  # rankwatch
                                 force=True)  # rankwatch
        ckpt.after_step(step)  # rankwatch
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        timed = args.steps - first - min(args.warmup, args.steps - first)
        print(f"time per step: {(time.perf_counter() - started) / max(timed, 1) * 1e3:.3f} ms over {timed} steps",
              flush=True)

    # every rank out of its last collective before any tears its process group down: gloo's ring finishes on the
    # ranks at different moments, and a peer that exits first can abort one still finishing (measured here: 3 of
    # 26 runs without this barrier ended "terminate called without an active exception", SIGABRT; 1 of ~100 with it)
    ckpt.close()  # rankwatch: the save in flight committed (or not) before the process group goes
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
