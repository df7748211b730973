"""A small transformer on a 2-D device mesh: tensor parallel within "tp", FSDP2 over "dp", with rankwatch attached.

    rankwatch torchrun --standalone --nproc-per-node 4 examples/fsdp_tp_2d.py --steps 100 --tp 2
    rankwatch analyze runs/fsdp_tp_2d-<time>

Tensor parallelism (`parallelize_module`) splits each block's attention heads and MLP hidden units across the "tp"
ranks (column-wise into a layer, row-wise out of it, as in Megatron-LM); FSDP2 (`fully_shard`) then shards every
block, and the root, over "dp". The ranks of one "tp" group read the same batch. Runs on CPU (gloo) or CUDA (NCCL).
The lines marked ``# rankwatch`` are all that rankwatch needs; under plain torchrun, set RANKWATCH_RUN_DIR.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _faults import Faults
from rankwatch import collector, recovery  # rankwatch


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the heads this rank holds (all of them without tensor parallelism, n_head / tp with it)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_head: int, n_layer: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
}
"""Each block's tensor-parallel plan: heads split across "tp" ranks, the MLP's hidden units too; one all-reduce
after attention and one after the MLP in forward (and their mirrors in backward)."""


Batch = tuple[torch.Tensor, torch.Tensor]


class TokenStream:
    """Synthetic next-token data: one stream per data-parallel coordinate, read alike by its tensor-parallel ranks.
    Resumable like torchdata's StatefulDataLoader: `state_dict` is its position and its generator's state."""

    def __init__(self, args: argparse.Namespace, dp_rank: int, device: torch.device) -> None:
        self.args, self.device, self.position = args, device, 0
        self.g = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)

    def __next__(self) -> Batch:
        tokens = torch.randint(self.args.vocab, (self.args.batch_size, self.args.seq_len + 1), generator=self.g)
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
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the world size)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the time per step is measured")
    parser.add_argument("--per-rank-seed", action="store_true", help="seed each rank with seed + rank")
    parser.add_argument("--fingerprint-every", type=int, default=10,
                        help="fingerprint the state every N steps (0: never)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="resume from the run's newest usable checkpoint")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints while training goes on")
    parser.add_argument("--compile", action="store_true",
                        help="compile each block after tensor parallelism (torch.compile; aot_eager on CPU)")
    args = parser.parse_args()

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device_type, backend = "cuda", "nccl"
    else:
        device_type, backend = "cpu", "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp or args.n_head % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size ({world}) and --n-head ({args.n_head})")
    mesh = init_device_mesh(device_type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    rw = collector.attach(mesh=mesh)  # rankwatch
    torch.manual_seed(args.seed + rank if args.per_rank_seed else args.seed)
    faults = Faults.from_env(rank)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")

    model = Transformer(args.vocab, args.d_model, args.n_head, args.n_layer, args.seq_len).to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        if args.compile:  # as torchtitan does: per block, after tensor parallelism, before FSDP
            block.compile(fullgraph=True, backend="inductor" if device_type == "cuda" else "aot_eager")
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    faults.watch(optimizer)
    data = TokenStream(args, mesh["dp"].get_local_rank(), device)

    numerics = {k: v for k, v in vars(args).items()
                if k not in ("steps", "warmup", "save_every", "resume", "async_save")}
    global_batch = args.batch_size * mesh['dp'].size()  # samples a step: every replica's batch
    ckpt = recovery.Checkpointer(rw, model, optimizer, lr_scheduler=None, grad_scaler=None, data=data,  # rankwatch
                                 rng={"torch": "per_rank" if args.per_rank_seed else "replicated"},  # rankwatch
                                 every=args.save_every, mesh=mesh, config=numerics,  # rankwatch
                                 global_batch=global_batch,  # rankwatch
                                 position=lambda: data.position * global_batch,  # rankwatch
                                 async_save=args.async_save)  # rankwatch
    first = ckpt.resume() if args.resume else 0  # rankwatch

    started = time.perf_counter()
    for step in range(first, args.steps):
        if step == first + args.warmup:
            started = time.perf_counter()
        with rw.step(step):  # rankwatch
            faults.inject(step, data)
            x, y = next(data)
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
