"""FSDP2 over a transformers causal LM, and the few collectives over Python objects the sharded worker needs.

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer, then to the whole model
(the root holds the embeddings, the final norm and the head), with ``sharding.mixed_precision`` as FSDP2's
``MixedPrecisionPolicy`` (parameters cast to the compute dtype for forward/backward, gradients reduced in float32)
and ``sharding.cpu_offload`` as its ``CPUOffloadPolicy`` (parameter shards, gradients and AdamW state in host
memory, the optimizer step on the CPU; a model on the CPU has nothing to offload and the option is a no-op there).
With ``cpu_offload`` on CUDA the process group needs a CPU backend beside NCCL (``init_process_group(
"cpu:gloo,cuda:nccl")``): the gradient clip's norm and the checkpoint's collectives then run on host tensors.
Gradients are *summed* over the ranks, not averaged (FSDP2's default): each rank back-propagates its share of a
mini-batch's micro-batches with the mini-batch's global weights, so the sum is the single-process gradient.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformers decoder layers (``GradientCheckpointingLayer``), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def shard_model(model: nn.Module, mixed_precision: str = "off", cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each decoder layer, then ``model`` (in place; returns it). ValueError for a model without
    transformers decoder layers (nothing to shard per layer)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"sharding: {type(model).__name__} has no transformers decoder layers to shard")
    dtype = _DTYPES.get(mixed_precision)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    on_cpu = next(model.parameters()).device.type == "cpu"  # already in host memory: nothing to offload
    offload = CPUOffloadPolicy() if cpu_offload and not on_cpu else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sum, not mean, over ranks (module docstring); gloo has no PREMUL_SUM
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_weights(sharded: nn.Module, replica: nn.Module) -> None:
    """Write the sharded model's whole parameters into ``replica`` (same names), in place. Collective."""
    target = dict(replica.named_parameters())
    for name, p in sharded.named_parameters():
        dest = target[name]
        whole = full_tensor(p.detach().to(dest.device))  # an offloaded (CPU) shard gathers on the replica's device
        dest.copy_(whole.to(dtype=dest.dtype))


def portable(err: Exception) -> Exception:
    """``err`` as it can travel to the other ranks: itself when it pickles, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` of rank ``src`` on every rank (pickled over the group); as it is with one process."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; ``[obj]`` with one process."""
    n = world()[1]
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def shares(items: Sequence[T], rank: int, size: int) -> list[tuple[T, float]]:
    """Rank ``rank``'s share of ``items`` (every ``size``-th from ``rank``), each with scale 1, padded with
    ``(items[0], 0.0)`` stand-ins to the longest share so every rank runs the same number of passes."""
    if not items:
        return []
    own = [(items[i], 1.0) for i in range(rank, len(items), size)]
    longest = -(-len(items) // size)
    return own + [(items[0], 0.0)] * (longest - len(own))
