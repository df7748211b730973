"""A small tensor- and pipeline-parallel MLP (Megatron-style) and the synthetic data it learns.

Each pipeline stage holds `blocks_per_stage` residual blocks; each block is a column-parallel linear, GELU and a
row-parallel linear, with the tensor-parallel all-reduces going through a caller-supplied `all_reduce` so the
collector times them. Stage 0 also holds the input projection, the last stage the output head (replicated over
tensor-parallel ranks). Initialization depends only on the seed and the stage/shard coordinates, so every
data-parallel replica starts bitwise identical and runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    d_in: int = 32
    """Input features."""
    d_model: int = 256
    """Residual width."""
    d_hidden: int = 1024
    """Hidden width of each block (split over tensor-parallel ranks)."""
    d_out: int = 8
    """Regression targets."""
    blocks_per_stage: int = 2
    """Residual blocks on each pipeline stage."""

    def __post_init__(self) -> None:
        for name in ("d_in", "d_model", "d_hidden", "d_out", "blocks_per_stage"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1")


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        ctx.all_reduce = all_reduce
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _init(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) / fan_in**0.5


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: int, tp_size: int, gen: torch.Generator) -> None:
        super().__init__()
        if cfg.d_hidden % tp_size:
            raise ValueError(f"d_hidden={cfg.d_hidden} is not divisible by tp={tp_size}")
        shard = cfg.d_hidden // tp_size
        w1 = _init((cfg.d_hidden, cfg.d_model), cfg.d_model, gen)
        w2 = _init((cfg.d_model, cfg.d_hidden), cfg.d_hidden, gen) * 0.5
        self.w1 = nn.Parameter(w1[tp * shard : (tp + 1) * shard].clone())
        self.b1 = nn.Parameter(torch.zeros(shard))
        self.w2 = nn.Parameter(w2[:, tp * shard : (tp + 1) * shard].clone())
        self.b2 = nn.Parameter(torch.zeros(cfg.d_model))
        self.tp_size = tp_size
        self.all_reduce: AllReduce = lambda t: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToTP.apply(x, self.all_reduce) if self.tp_size > 1 else x
        h = torch.nn.functional.gelu(torch.nn.functional.linear(h, self.w1, self.b1))
        y = torch.nn.functional.linear(h, self.w2)
        if self.tp_size > 1:
            y = _ReduceFromTP.apply(y, self.all_reduce)
        return x + y + self.b2


class Stage(nn.Module):
    """One pipeline stage of the canary model, for one tensor-parallel rank."""

    def __init__(self, cfg: ModelConfig, *, seed: int, pp: int, pp_size: int, tp: int, tp_size: int) -> None:
        super().__init__()
        self.first, self.last = pp == 0, pp == pp_size - 1
        gen = torch.Generator().manual_seed(seed * 1000 + pp)  # same on every tp/dp rank of the stage
        self.inp = nn.Linear(cfg.d_in, cfg.d_model) if self.first else None
        if self.inp is not None:
            with torch.no_grad():
                self.inp.weight.copy_(_init((cfg.d_model, cfg.d_in), cfg.d_in, gen))
                self.inp.bias.zero_()
        self.blocks = nn.ModuleList(Block(cfg, tp=tp, tp_size=tp_size, gen=gen) for _ in range(cfg.blocks_per_stage))
        self.head = nn.Linear(cfg.d_model, cfg.d_out) if self.last else None
        if self.head is not None:
            with torch.no_grad():
                self.head.weight.copy_(_init((cfg.d_out, cfg.d_model), cfg.d_model, gen))
                self.head.bias.zero_()

    def set_all_reduce(self, fn: AllReduce) -> None:
        for b in self.blocks:
            assert isinstance(b, Block)
            b.all_reduce = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        if self.head is not None:
            x = self.head(x)
        return x


class SyntheticRegression:
    """Deterministic samples: sample i depends only on (seed, i); targets come from a fixed random teacher."""

    def __init__(self, cfg: ModelConfig, *, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        gen = torch.Generator().manual_seed(10_007 * seed + 17)
        self._teacher1 = torch.randn(cfg.d_in, 64, generator=gen) / cfg.d_in**0.5
        self._teacher2 = torch.randn(64, cfg.d_out, generator=gen) / 8.0

    def batch(self, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [start, start + size)."""
        gen = torch.Generator().manual_seed((self.seed << 32) ^ start)
        x = torch.randn(size, self.cfg.d_in, generator=gen)
        y = torch.tanh(x @ self._teacher1) @ self._teacher2
        return x, y


class ShardedLoader:
    """Yields this data-parallel rank's slice of each global batch and tracks the global data position.

    `position` is the number of samples the job has consumed: equal on every rank of a healthy job."""

    def __init__(self, data: SyntheticRegression, *, global_batch: int, dp: int, dp_size: int, position: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        self.data = data
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp = dp
        self.position = position

    def skip(self, samples: int) -> None:
        self.position += samples

    def state_dict(self) -> dict[str, int]:
        """The data position as a checkpoint keeps it (`recovery.Checkpointer`'s `data`): the global sample count,
        which any dp degree re-slices."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.position + self.dp * self.local_batch
        self.position += self.global_batch
        return self.data.batch(start, self.local_batch)
