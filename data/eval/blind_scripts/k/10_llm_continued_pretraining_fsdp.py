"""Continued pretraining of a Llama-style base model on our domain corpus (FSDP, full shard, bf16).

Slurm (sbatch wrapper runs one torchrun per node):
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_id=$SLURM_JOB_ID \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 10_llm_continued_pretraining_fsdp.py --config cpt.yaml
"""
import argparse
import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


@dataclass
class CPTConfig:
    model_path: str = "/models/llama-3-8b"
    tokens_bin: str = "/data/domain_corpus/tokens_uint32.bin"
    seq_len: int = 4096
    micro_batch: int = 1
    grad_accum: int = 16
    lr: float = 2e-5
    min_lr: float = 2e-6
    warmup_steps: int = 200
    max_steps: int = 20000
    save_every: int = 1000
    log_every: int = 10
    out_dir: str = "/ckpt/cpt-llama3-domain"


class PackedTokens(Dataset):
    """Fixed-length windows over one pre-tokenised memmap (documents already joined with EOS)."""

    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len
        self.n = len(self.data) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        chunk = np.asarray(self.data[i * self.seq_len:(i + 1) * self.seq_len], dtype=np.int64)
        return torch.from_numpy(chunk)


def lr_at(step, cfg: CPTConfig):
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def save_checkpoint(model, step, cfg, rank):
    if rank == 0:
        full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg):
            cpu_state = model.state_dict()
        path = os.path.join(cfg.out_dir, f"step_{step:06d}")
        os.makedirs(path, exist_ok=True)
        torch.save(cpu_state, os.path.join(path, "pytorch_model.bin"))
        print(f"[ckpt] saved {path}", flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = CPTConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device,
                 use_orig_params=True, limit_all_gathers=True)

    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)

    ds = PackedTokens(cfg.tokens_bin, cfg.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.micro_batch, sampler=sampler, num_workers=4, pin_memory=True)
    if rank == 0:
        print(f"{len(ds)} windows, {world} ranks, global batch "
              f"{cfg.micro_batch * cfg.grad_accum * world * cfg.seq_len / 1e6:.2f}M tokens", flush=True)

    step, epoch, micro = 0, 0, 0
    sampler.set_epoch(epoch)
    it = iter(loader)
    model.train()
    loss_acc = torch.zeros((), device=device)
    t0 = time.time()
    while step < cfg.max_steps:
        try:
            x = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x = next(it)
        x = x.to(device, non_blocking=True)
        micro += 1
        last_micro = micro % cfg.grad_accum == 0
        ctx = contextlib.nullcontext() if last_micro else model.no_sync()
        with ctx:
            loss = model(input_ids=x, labels=x).loss  # HF shifts labels internally
            (loss / cfg.grad_accum).backward()
        loss_acc += loss.detach() / cfg.grad_accum
        if not last_micro:
            continue

        for g in optim.param_groups:
            g["lr"] = lr_at(step, cfg)
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % cfg.log_every == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = time.time() - t0
                tok_s = cfg.log_every * cfg.grad_accum * cfg.micro_batch * cfg.seq_len * world / dt
                print(f"step {step} loss {loss_acc.item() / cfg.log_every:.4f} lr {lr_at(step, cfg):.2e} "
                      f"{tok_s / 1e3:.1f}k tok/s", flush=True)
            loss_acc.zero_()
            t0 = time.time()
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(model, step, cfg, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
