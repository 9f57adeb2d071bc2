"""Process-group setup and the optional DeepSpeed engine.

Launch (the loop is the same in every case):

    python -m train +recipe=eagle3                                   # one process
    torchrun --nproc_per_node 2 -m train +recipe=eagle3 deepspeed=zero2 output_dir=runs/x
    deepspeed --num_gpus 2 --no_local_rank --module train +recipe=eagle3 deepspeed=zero2 output_dir=runs/x

(Hydra rejects ``--local_rank``, hence ``--no_local_rank``; pass ``output_dir`` explicitly so all
ranks agree on it.) Backend: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return Dist(dist.get_rank() if dist.is_initialized() else 0, max(world, 1), 0)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
    return Dist(dist.get_rank(), dist.get_world_size(), local)


def deepspeed_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     ds_config: dict, micro_batch: int, grad_accum: int, world_size: int, device: str) -> Any:
    import deepspeed

    # The shm comm op compiles for ~40 s on first use and buys nothing for a drafter's few MB.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cfg = dict(ds_config)
    cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum,
               train_batch_size=micro_batch * grad_accum * world_size)
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        cfg["bf16"] = {"enabled": True}
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=cfg, model_parameters=None)
    return engine
