# Full-parameter SFT of a Llama-3 style model with FSDP (FULL_SHARD, bf16).
# torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
#     02_fsdp_llama_sft.py --model meta-llama/Llama-3.2-3B --data data/packed_sft
import argparse
import functools
import os
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


@dataclass
class Config:
    model: str = "meta-llama/Llama-3.2-3B"
    data: str = "data/packed_sft"
    out: str = "ckpt/llama_sft"
    seq_len: int = 4096
    micro_bsz: int = 2
    lr: float = 1e-5
    min_lr: float = 1e-6
    warmup: int = 100
    epochs: int = 1
    weight_decay: float = 0.1
    clip: float = 1.0
    save_every: int = 500
    log_every: int = 10
    wandb_project: str = "llama-sft"


def parse() -> Config:
    p = argparse.ArgumentParser()
    for f in fields(Config):
        p.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return Config(**vars(p.parse_args()))


class PackedTokens(Dataset):
    """Pre-packed uint32 token stream + loss mask written by prepare_sft.py."""

    def __init__(self, root, seq_len):
        import numpy as np
        self.tokens = np.memmap(os.path.join(root, "tokens.bin"), dtype=np.uint32, mode="r")
        self.mask = np.memmap(os.path.join(root, "mask.bin"), dtype=np.uint8, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        x = torch.from_numpy(self.tokens[s: s + self.seq_len + 1].astype("int64"))
        m = torch.from_numpy(self.mask[s + 1: s + self.seq_len + 1].astype("bool"))
        y = x[1:].clone()
        y[~m] = -100
        return x[:-1], y


def lr_at(step, total, cfg):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    import math
    t = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def build_model(cfg, rank, local_rank):
    # only rank 0 materialises the weights; the others build on meta and get them via sync_module_states
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model),
                                                     torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.device("cuda"), recurse=False)) if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    return model


def save_full(model, optim, step, cfg, rank):
    # every rank must enter state_dict(): the full params are all-gathered, only rank 0 keeps them on CPU
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        path = os.path.join(cfg.out, f"step_{step}")
        os.makedirs(path, exist_ok=True)
        torch.save(model_sd, os.path.join(path, "model.pt"))
        torch.save({"optim": optim_sd, "step": step}, os.path.join(path, "optim.pt"))
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    run = None
    if rank == 0:
        import wandb
        run = wandb.init(project=cfg.wandb_project, config=asdict(cfg) | {"world_size": world})

    model = build_model(cfg, rank, local_rank)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                              weight_decay=cfg.weight_decay, fused=True)

    ds = PackedTokens(cfg.data, cfg.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=17, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.micro_bsz, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    total = len(dl) * cfg.epochs
    if rank == 0:
        print(f"{len(ds)} sequences, {total} steps, {world} ranks", flush=True)

    step = 0
    model.train()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for x, y in dl:
            x = x.cuda(non_blocking=True)
            y = y.cuda(non_blocking=True)
            for g in optim.param_groups:
                g["lr"] = lr_at(step, total, cfg)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                     ignore_index=-100)
            loss.backward()
            gnorm = model.clip_grad_norm_(cfg.clip)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0:
                stats = torch.stack([loss.detach().float(), gnorm.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.perf_counter() - t0) / cfg.log_every
                    tps = cfg.micro_bsz * cfg.seq_len * world / dt
                    run.log({"loss": stats[0].item(), "grad_norm": stats[1].item(),
                             "lr": optim.param_groups[0]["lr"], "tok/s": tps}, step=step)
                t0 = time.perf_counter()

            if step % cfg.save_every == 0:
                save_full(model, optim, step, cfg, rank)

    save_full(model, optim, step, cfg, rank)
    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
