"""Supervised fine-tuning of a decoder LM with FSDP on a preemptible SLURM partition.

sbatch sends SIGUSR1 ~3 minutes before the time limit; we checkpoint and requeue.
"""
import logging
import math
import os
import signal
import subprocess
import time
from functools import partial

import hydra
import torch
import torch.distributed as dist
import wandb
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from sft_data import SFTDataset, collate_sft

log = logging.getLogger(__name__)

_PREEMPT = {"flag": False}


def _on_sigusr1(signum, frame):
    # only set a flag here; the training loop decides collectively when to stop
    _PREEMPT["flag"] = True


def full_state_cfgs(rank0_only):
    return (
        FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
    )


def save_checkpoint(cfg, model, optimizer, scheduler, epoch, step_in_epoch, global_step, rank, world):
    model_cfg, optim_cfg = full_state_cfgs(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(cfg.run.ckpt_dir, exist_ok=True)
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "global_step": global_step,
            "world_size": world,
            "wandb_id": wandb.run.id if wandb.run else None,
        }
        tmp = os.path.join(cfg.run.ckpt_dir, "last.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(cfg.run.ckpt_dir, "last.pt"))
        log.info("checkpoint written at step %d", global_step)
    dist.barrier()


def build_model(cfg, local_rank, resume_state):
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if resume_state is not None:
        model.load_state_dict(resume_state["model"])
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    wrap = partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(
        model,
        auto_wrap_policy=wrap,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        use_orig_params=True,
        limit_all_gathers=True,
    )


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != -100).sum()
        acc[0] += out.loss.float() * n_tok
        acc[1] += n_tok
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


@hydra.main(config_path="conf", config_name="sft", version_base="1.3")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    signal.signal(signal.SIGUSR1, _on_sigusr1)

    ckpt_path = os.path.join(cfg.run.ckpt_dir, "last.pt")
    resume_state = torch.load(ckpt_path, map_location="cpu") if os.path.exists(ckpt_path) else None

    if rank == 0:
        wandb.init(
            project=cfg.wandb.project,
            name=cfg.run.name,
            id=resume_state["wandb_id"] if resume_state else None,
            resume="allow",
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    train_ds = SFTDataset(cfg.data.train_path, tokenizer, cfg.data.max_len)
    val_ds = SFTDataset(cfg.data.val_path, tokenizer, cfg.data.max_len)
    collate = partial(collate_sft, pad_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.micro_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.train.micro_batch,
                            sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, local_rank, resume_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.wd,
                                  betas=(0.9, 0.95))
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, cfg.train.warmup_steps, steps_per_epoch * cfg.train.epochs
    )

    start_epoch, skip_batches, global_step = 0, 0, 0
    if resume_state is not None:
        # every rank holds the full optimizer state on CPU; shard it into this rank's FSDP view
        model_cfg, optim_cfg = full_state_cfgs(rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
            osd = FSDP.optim_state_dict_to_load(model, optimizer, resume_state["optimizer"])
        optimizer.load_state_dict(osd)
        scheduler.load_state_dict(resume_state["scheduler"])
        start_epoch = resume_state["epoch"]
        global_step = resume_state["global_step"]
        if resume_state["world_size"] == world:
            skip_batches = resume_state["step_in_epoch"] * cfg.train.grad_accum
        else:
            log.warning("world size changed %d -> %d, restarting epoch %d from its first batch",
                        resume_state["world_size"], world, start_epoch)
        del resume_state

    stop = torch.zeros(1, device=device)
    t_last = time.time()
    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        step_in_epoch = skip_batches // cfg.train.grad_accum
        for i, batch in enumerate(train_loader):
            if i < skip_batches:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / cfg.train.grad_accum
            loss.backward()
            if (i + 1) % cfg.train.grad_accum != 0:
                continue

            model.clip_grad_norm_(cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_in_epoch += 1
            global_step += 1

            if global_step % cfg.run.log_every == 0:
                l = loss.detach() * cfg.train.grad_accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = time.time() - t_last
                    wandb.log({"train/loss": l.item(), "lr": scheduler.get_last_lr()[0],
                               "sec_per_step": dt / cfg.run.log_every}, step=global_step)
                t_last = time.time()

            stop.fill_(1.0 if _PREEMPT["flag"] else 0.0)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                save_checkpoint(cfg, model, optimizer, scheduler, epoch, step_in_epoch,
                                global_step, rank, world)
                if rank == 0:
                    wandb.finish(exit_code=0)
                    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
                dist.destroy_process_group()
                return

        skip_batches = 0
        val_loss = evaluate(model, val_loader, device)
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss), "epoch": epoch}, step=global_step)
        save_checkpoint(cfg, model, optimizer, scheduler, epoch + 1, 0, global_step, rank, world)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
