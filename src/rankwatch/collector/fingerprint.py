"""State fingerprints: short deterministic hashes of what ranks of one consistency domain must agree on.

XXH3-64 over raw tensor bytes (plus names, dtypes and shapes), so a single flipped bit anywhere changes the
hash. XXH3 runs at about memory bandwidth, an order faster than BLAKE2b; these hashes detect
accidents, not adversaries. Cost is one read of the state, without copies on the host; on CUDA the tensors are
copied to the host, which is why fingerprints are taken every N steps rather than every step.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import xxhash


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    param_hash: str
    optim_hash: str
    rng_python_hash: str
    rng_numpy_hash: str
    rng_torch_hash: str
    rng_cuda_hash: str | None
    param_count: int


def _new() -> Any:
    return xxhash.xxh3_64()


def _update_tensor(h: Any, t: torch.Tensor) -> None:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().data)


def hash_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int]:
    """Hash (name, tensor) pairs in the given order; returns (hex digest, element count)."""
    h = _new()
    count = 0
    for name, t in named:
        h.update(name.encode())
        _update_tensor(h, t)
        count += t.numel()
    return h.hexdigest(), count


def _hash_value(h: Any, value: object) -> None:
    if isinstance(value, torch.Tensor):
        _update_tensor(h, value)
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _hash_value(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _hash_value(h, v)
    else:
        h.update(repr(value).encode())


def hash_optimizer(optimizer: torch.optim.Optimizer | None) -> str:
    """Hash optimizer state (per-parameter tensors and step counts, in parameter order) and hyper-parameters.

    Reads `optimizer.state` directly: `state_dict()` would rebuild the whole structure on every call."""
    h = _new()
    if optimizer is not None:
        for index, group in enumerate(optimizer.param_groups):
            _hash_value(h, {k: v for k, v in group.items() if k != "params"})
            for position, p in enumerate(group["params"]):
                h.update(f"{index}.{position}".encode())
                _hash_value(h, optimizer.state.get(p, {}))
    return h.hexdigest()


def _digest(data: bytes) -> str:
    h = _new()
    h.update(data)
    return h.hexdigest()


def rng_hashes() -> tuple[str, str, str, str | None]:
    """Hashes of the python, numpy, torch CPU and CUDA (None without CUDA) global RNG states."""
    py = _digest(pickle.dumps(random.getstate(), protocol=4))
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    h = _new()
    _hash_value(h, [np_state[0], np_state[2], np_state[3], np_state[4]])
    h.update(np.asarray(np_state[1]).tobytes())
    cpu = _digest(torch.get_rng_state().numpy().tobytes())
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        hc = _new()
        for state in torch.cuda.get_rng_state_all():
            hc.update(state.numpy().tobytes())
        cuda = hc.hexdigest()
    return py, h.hexdigest(), cpu, cuda


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Fingerprint:
    param_hash, count = hash_tensors(model.named_parameters())
    py, npy, cpu, cuda = rng_hashes()
    return Fingerprint(
        param_hash=param_hash,
        optim_hash=hash_optimizer(optimizer),
        rng_python_hash=py,
        rng_numpy_hash=npy,
        rng_torch_hash=cpu,
        rng_cuda_hash=cuda,
        param_count=count,
    )
