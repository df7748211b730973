"""State fingerprints: short deterministic hashes of what ranks of one consistency domain must agree on.

XXH3-64 over raw tensor bytes (plus names, dtypes and shapes), so a single flipped bit anywhere changes the
hash. XXH3 runs at about memory bandwidth, an order faster than BLAKE2b; these hashes detect
accidents, not adversaries. Cost is one read of the state, without copies on the host; on CUDA the tensors are
copied to the host, which is why fingerprints are taken every N steps rather than every step.

Sharded state is hashed from what this rank holds: a DTensor (FSDP2 parameters and their optimizer state, tensor
parallel weights) from its local shard, so the hash equals that of the plain local tensor. `consistency_domain`
says which ranks must then hold the same hashes.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterable, Mapping, Sequence
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
    """Parameter elements hashed: local elements of sharded (DTensor) parameters."""
    unhashed: int = 0
    """Tensors (parameters and optimizer state) whose bytes could not be read, each hashed as a marker of its type,
    dtype and shape only: a tensor subclass with neither `to_local` nor a flatten protocol nor plain storage."""
    nonfinite_params: int = 0
    """Non-finite (NaN, inf) elements in the parameters this rank holds (a DTensor's local shard)."""
    nonfinite_optim: int = 0
    """... and in its optimizer state tensors."""


_MAX_NESTING = 4
"""Subclass unwrapping depth (a local shard that is itself a subclass, ...): beyond it a tensor is a marker."""


def _new() -> Any:
    return xxhash.xxh3_64()


def _update_plain(h: Any, t: torch.Tensor) -> int:
    """Hash a plain tensor's dtype, shape and bytes; returns its element count. Raises when the bytes cannot be read
    (the caller decides whether that is a marker)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = t.view(-1).view(torch.uint8).numpy().data if t.numel() else None
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if data is not None:
        h.update(data)
    return t.numel()


def _update_tensor(h: Any, t: torch.Tensor, depth: int = 0) -> tuple[int, int]:
    """Hash one tensor; returns (elements hashed, tensors hashed as a marker)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the fast path: no unwrapping, no extra copy
        return _update_plain(h, t.detach()), 0
    return _update_subclass(h, t, depth)


def _update_subclass(h: Any, t: torch.Tensor, depth: int) -> tuple[int, int]:
    """A tensor subclass, hashed from what this rank holds; never raises.

    - `to_local()` (DTensor, and FSDP2's sharded parameters, which are DTensors): the local shard, hashed exactly as
      the plain tensor it is. Under no_grad `DTensor.to_local` returns the local tensor (a view of it for a
      Parameter), no autograd node and no copy (torch/distributed/tensor/_api.py, `DTensor.to_local`).
    - a wrapper subclass with the flatten protocol (`__tensor_flatten__` -> inner tensor attribute names, the
      `TraceableWrapperSubclass` protocol of torch/utils/_python_dispatch.py): its type name, then each inner
      tensor under its attribute name.
    - any other subclass with storage: its bytes as a plain tensor view (`as_subclass(torch.Tensor)`, no copy).
    - else (or past `_MAX_NESTING`): a marker of type, dtype and shape, counted.
    """
    if depth < _MAX_NESTING:
        try:
            with torch.no_grad():
                to_local = getattr(t, "to_local", None)
                if callable(to_local):
                    local = to_local()
                    if isinstance(local, torch.Tensor) and local is not t:
                        return _update_tensor(h, local, depth + 1)
                detached = t.detach()
                if type(detached) is torch.Tensor:  # e.g. a Parameter subclass over a plain tensor
                    return _update_plain(h, detached), 0
                flatten = getattr(detached, "__tensor_flatten__", None)
                if callable(flatten):
                    attrs, _ = flatten()
                    h.update(type(detached).__qualname__.encode())
                    elements = marked = 0
                    for attr in attrs:
                        h.update(attr.encode())
                        e, m = _update_tensor(h, getattr(detached, attr), depth + 1)
                        elements, marked = elements + e, marked + m
                    return elements, marked
                return _update_plain(h, torch.Tensor.as_subclass(detached, torch.Tensor)), 0
        except Exception:  # a subclass whose bytes cannot be read is a marker, not an error
            pass
    # a failure above may have fed part of this tensor to `h`: every member fails at the same point on equal state
    h.update(f"\x00unhashable {type(t).__qualname__} {t.dtype}{tuple(t.shape)}".encode())
    return 0, 1


def _hash_named(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int]:
    h = _new()
    count = marked = 0
    for name, t in named:
        h.update(name.encode())
        e, m = _update_tensor(h, t)
        count, marked = count + e, marked + m
    return h.hexdigest(), count, marked


def hash_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int]:
    """Hash (name, tensor) pairs in the given order; returns (hex digest, elements hashed: local ones of a DTensor)."""
    digest, count, _ = _hash_named(named)
    return digest, count


def _hash_value(h: Any, value: object) -> int:
    """Hash a (nested) value; returns the number of tensors hashed as a marker."""
    if isinstance(value, torch.Tensor):
        return _update_tensor(h, value)[1]
    marked = 0
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            marked += _hash_value(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            marked += _hash_value(h, v)
    else:
        h.update(repr(value).encode())
    return marked


def _hash_optimizer(optimizer: torch.optim.Optimizer | None) -> tuple[str, int]:
    h = _new()
    marked = 0
    if optimizer is not None:
        for index, group in enumerate(optimizer.param_groups):
            marked += _hash_value(h, {k: v for k, v in group.items() if k != "params"})
            for position, p in enumerate(group["params"]):
                h.update(f"{index}.{position}".encode())
                marked += _hash_value(h, optimizer.state.get(p, {}))
    return h.hexdigest(), marked


def hash_optimizer(optimizer: torch.optim.Optimizer | None) -> str:
    """Hash optimizer state (per-parameter tensors and step counts, in parameter order) and hyper-parameters.

    Reads `optimizer.state` directly: `state_dict()` would rebuild the whole structure on every call. State that is
    a DTensor (AdamW's `exp_avg` of an FSDP2 parameter) is hashed from its local shard."""
    return _hash_optimizer(optimizer)[0]


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


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The floating-point tensor this rank holds of `t` (a DTensor's local shard), None for any other."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local) and type(t) is not torch.Tensor:
        try:
            t = to_local()
        except Exception:
            return None
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() else None


def _nonfinite(tensors: Iterable[object]) -> int:
    """Non-finite elements in `tensors` (their local shards); a tensor whose values cannot be read (a subclass whose
    ops fail, as `_update_subclass` hashes as a marker) counts none."""
    count = 0
    with torch.no_grad():
        for t in tensors:
            local = _local(t) if isinstance(t, torch.Tensor) else None
            if local is None:
                continue
            try:
                count += int(local.numel() - torch.isfinite(local).sum().item())
            except Exception:
                continue
    return count


def nonfinite_counts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[int, int]:
    """(non-finite elements in the parameters this rank holds, in its optimizer state tensors). Counted where the
    tensors are (on the GPU: one scalar comes back per tensor)."""
    optim = 0
    if optimizer is not None:
        optim = _nonfinite(v for state in optimizer.state.values() if isinstance(state, Mapping)
                           for v in state.values())
    return _nonfinite(model.parameters()), optim


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Fingerprint:
    param_hash, count, marked_params = _hash_named(model.named_parameters())
    optim_hash, marked_optim = _hash_optimizer(optimizer)
    py, npy, cpu, cuda = rng_hashes()
    bad_params, bad_optim = nonfinite_counts(model, optimizer)
    return Fingerprint(
        nonfinite_params=bad_params, nonfinite_optim=bad_optim,
        param_hash=param_hash,
        optim_hash=optim_hash,
        rng_python_hash=py,
        rng_numpy_hash=npy,
        rng_torch_hash=cpu,
        rng_cuda_hash=cuda,
        param_count=count,
        unhashed=marked_params + marked_optim,
    )


def mesh_peers(mesh: Sequence[Any] | np.ndarray, rank: int, fixed: Sequence[bool]) -> tuple[int, ...]:
    """The ranks of a device mesh (an n-d array of global ranks) whose coordinates equal `rank`'s on every dimension
    where `fixed` is true, sorted: the ranks that hold the same local shard as `rank` of a tensor that is sharded
    (or partial) on the fixed dimensions and replicated on the others. Raises `ValueError` when `rank` is not in the
    mesh exactly once or `fixed` does not give one flag per dimension."""
    ranks = np.asarray(mesh, dtype=np.int64)
    if ranks.ndim != len(fixed):
        raise ValueError(f"mesh_peers: {ranks.ndim}-d mesh, {len(fixed)} 'fixed' flags")
    where = np.argwhere(ranks == rank)
    if len(where) != 1:
        raise ValueError(f"mesh_peers: rank {rank} appears {len(where)} times in the mesh")
    index = tuple(int(c) if f else slice(None) for c, f in zip(where[0], fixed))
    return tuple(sorted(int(r) for r in np.ravel(ranks[index])))


def domain_name(ranks: Sequence[int]) -> str:
    """A domain's name from its member ranks, the same on every member: 'replicas:' then the sorted ranks, an
    arithmetic run of three or more as 'first-last' ('/step' when the step is not 1), else comma-separated."""
    members = sorted(set(ranks))
    if not members:
        raise ValueError("domain_name: no ranks")
    step = members[1] - members[0] if len(members) >= 3 else 0
    if step and all(b - a == step for a, b in zip(members, members[1:])):
        text = f"{members[0]}-{members[-1]}" + (f"/{step}" if step != 1 else "")
    else:
        text = ",".join(map(str, members))
    return f"replicas:{text}"


def consistency_domain(
    model: torch.nn.Module, rank: int, world_size: int, *, replicas: Sequence[int] | None = None
) -> tuple[str, tuple[int, ...]]:
    """The consistency domain of this rank's fingerprints: (name, sorted member ranks), the ranks that must hold
    bitwise-equal local parameters and optimizer state. Every member computes the same name.

    - A plain parameter (DDP, or no parallelism) must be equal on every data-parallel replica: `replicas` (this
      rank's data-parallel group) when given, else the whole world.
    - A DTensor parameter (FSDP2, tensor parallel, HSDP) must be equal on the ranks of its device mesh whose
      coordinates equal this rank's on every mesh dimension where its placement is not `Replicate` (`Shard`,
      `_StridedShard` and `Partial` hold different local tensors per coordinate; `Placement.is_replicate`,
      torch/distributed/tensor/placement_types.py), varying over the replicated dimensions. A rank outside the
      parameter's mesh holds an empty local tensor (`DeviceMesh._is_current_rank_part_of_mesh`,
      torch/distributed/device_mesh.py), as does every other rank outside it.
    - The domain is the intersection over all parameters (one hash covers them all).

    So over 4 ranks: DDP -> all 4; pure FSDP2 -> this rank alone; HSDP (replicate 2 x shard 2) -> this rank and its
    replicate peer; FSDP 2 x TP 2 -> this rank alone.

    A one-member domain checks nothing across ranks: the divergence and corruption detectors compare only domains
    of two or more members, and step, RNG state and data position sit in the same rows, so they are not compared
    across ranks either. What remains is per rank: replay verification (`analytics.replay`) compares the rank's
    fingerprints with an earlier attempt's at the same step, and the restart gate (`recovery.gate`) compares step
    and data position over the world.

    Parameters are read where they are now: call it while they are sharded (FSDP2 reshards after backward), not
    between an unsharding forward and its backward.
    """
    plain = frozenset(replicas) if replicas is not None else frozenset(range(world_size))
    if rank not in plain:
        raise ValueError(f"consistency_domain: rank {rank} is not among its replicas {sorted(plain)}")
    dtensor = _dtensor_type()
    per_layout: dict[tuple[Any, tuple[bool, ...]], frozenset[int]] = {}
    members = plain if dtensor is None else None
    for p in model.parameters():
        if dtensor is not None and isinstance(p, dtensor):
            d: Any = p
            key = (d.device_mesh, tuple(not placement.is_replicate() for placement in d.placements))
            peers = per_layout.get(key)
            if peers is None:
                peers = per_layout[key] = _dtensor_peers(key[0], rank, world_size, key[1])
        else:
            peers = plain
        members = peers if members is None else members & peers
    ranks = tuple(sorted(plain if members is None else members))
    return domain_name(ranks), ranks


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _dtensor_peers(mesh: Any, rank: int, world_size: int, fixed: tuple[bool, ...]) -> frozenset[int]:
    # `DeviceMesh.mesh`: the n-d tensor of global ranks of this rank's (sub)mesh (torch/distributed/device_mesh.py)
    ranks = mesh.mesh.tolist()
    flat = set(np.ravel(np.asarray(ranks, dtype=np.int64)).tolist())
    if rank not in flat:
        return frozenset(range(world_size)) - flat
    return frozenset(mesh_peers(ranks, rank, fixed))
