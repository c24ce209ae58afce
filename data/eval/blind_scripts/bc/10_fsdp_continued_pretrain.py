"""Continued pretraining of a 1.1B Llama-architecture decoder on domain text with FSDP.

    torchrun --nnodes=4 --nproc-per-node=8 --max-restarts=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID cpt.py +experiment=legal_1b
"""
import functools
import glob
import logging
import math
import os
import time

import hydra
import numpy as np
import torch
import torch.distributed as dist
import wandb
from omegaconf import DictConfig, OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

log = logging.getLogger("cpt")


class PackedTokens(Dataset):
    def __init__(self, pattern, seq_len):
        self.shards = [np.load(p, mmap_mode="r") for p in sorted(glob.glob(pattern))]
        self.seq_len = seq_len
        self.offsets = np.cumsum([0] + [len(s) // (seq_len + 1) for s in self.shards])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, idx):
        s = int(np.searchsorted(self.offsets, idx, side="right") - 1)
        j = idx - self.offsets[s]
        row = torch.from_numpy(self.shards[s][j * (self.seq_len + 1):(j + 1) * (self.seq_len + 1)].astype(np.int64))
        return {"input_ids": row[:-1], "labels": row[1:]}


def save_checkpoint(cfg, model, optimizer, scheduler, step, epoch, rank):
    path = os.path.join(cfg.paths.ckpt_dir, f"step_{step:07d}.pt")
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        model_state = model.state_dict()
        if rank == 0:
            optim_state = FSDP.optim_state_dict(model, optimizer)
            os.makedirs(cfg.paths.ckpt_dir, exist_ok=True)
            torch.save({"model": model_state, "optimizer": optim_state,
                        "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch}, path)
            with open(os.path.join(cfg.paths.ckpt_dir, "latest"), "w") as f:
                f.write(os.path.basename(path))
            log.info("saved %s", path)
    dist.barrier()


def latest_checkpoint(cfg):
    marker = os.path.join(cfg.paths.ckpt_dir, "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return os.path.join(cfg.paths.ckpt_dir, f.read().strip())


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"]).logits
        tot[0] += torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        tot[1] += batch["labels"].numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


@hydra.main(config_path="configs", config_name="cpt", version_base="1.3")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    resume = latest_checkpoint(cfg)
    state = torch.load(resume, map_location="cpu") if resume else None

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=torch.float32)
    model.config.use_cache = False
    if state is not None:
        model.load_state_dict(state["model"])
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={LlamaDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if cfg.fsdp.hybrid else ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        sync_module_states=False,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.optim.wd, fused=True)
    train_ds = PackedTokens(cfg.data.train_glob, cfg.data.seq_len)
    val_ds = PackedTokens(cfg.data.val_glob, cfg.data.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.optim.micro_batch, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.optim.micro_batch,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))
    total_steps = cfg.optim.epochs * len(loader)

    def lr_lambda(s):
        if s < cfg.optim.warmup:
            return s / cfg.optim.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - cfg.optim.warmup) / (total_steps - cfg.optim.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    step, start_epoch = 0, 0
    if state is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optimizer"]))
        scheduler.load_state_dict(state["scheduler"])
        step, start_epoch = state["step"], state["epoch"]
        del state

    if rank == 0:
        wandb.init(project=cfg.wandb.project, name=cfg.run_name, resume="allow", id=cfg.run_name,
                   config=OmegaConf.to_container(cfg, resolve=True))

    t0 = time.time()
    for epoch in range(start_epoch, cfg.optim.epochs):
        sampler.set_epoch(epoch)
        skip = step - epoch * len(loader)
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
            loss.backward()
            gnorm = model.clip_grad_norm_(cfg.optim.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = cfg.log_every * cfg.optim.micro_batch * cfg.data.seq_len * world / (time.time() - t0)
                    wandb.log({"loss": l.item(), "gnorm": gnorm.item(), "lr": scheduler.get_last_lr()[0],
                               "tokens_per_s": tps}, step=step)
                t0 = time.time()
            if step % cfg.eval_every == 0:
                val = evaluate(model, val_loader, device, cfg.eval_batches)
                if rank == 0:
                    wandb.log({"val_loss": val, "val_ppl": math.exp(val)}, step=step)
            if step % cfg.save_every == 0:
                save_checkpoint(cfg, model, optimizer, scheduler, step, epoch, rank)

    save_checkpoint(cfg, model, optimizer, scheduler, step, cfg.optim.epochs, rank)
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
