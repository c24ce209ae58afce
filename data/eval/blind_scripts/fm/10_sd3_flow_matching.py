#!/usr/bin/env python
"""SD3-medium transformer fine-tuning (rectified flow) with FSDP.

Text embeddings (CLIP-L + CLIP-G + T5) are precomputed offline and stored next
to the VAE latents, so only the MMDiT is on the GPUs during training.

    torchrun --nproc_per_node=8 10_sd3_flow_matching.py --data /data/sd3_cache/train --val /data/sd3_cache/val
"""
import argparse
import functools
import glob
import logging
import math
import os

import torch
import torch.distributed as dist
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sd3-ft")


class CachedLatents(Dataset):
    """Each .safetensors file holds latents [16,h,w], prompt_embeds [333,4096], pooled [2048]."""

    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.safetensors")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = load_file(self.files[i])
        return d["latents"], d["prompt_embeds"], d["pooled"]


def logit_normal_timesteps(n, device, m=0.0, s=1.0):
    u = torch.normal(mean=m, std=s, size=(n,), device=device)
    return torch.sigmoid(u)


def flow_loss(model, latents, prompt_embeds, pooled):
    noise = torch.randn_like(latents)
    sigmas = logit_normal_timesteps(latents.shape[0], latents.device).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = model(hidden_states=noisy, timestep=sigmas.flatten() * 1000.0,
                 encoder_hidden_states=prompt_embeds, pooled_projections=pooled, return_dict=False)[0]
    target = noise - latents
    return torch.mean((pred.float() - target.float()) ** 2)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    g = torch.Generator(device=device).manual_seed(0)
    tot = torch.zeros(2, device=device)
    for lat, emb, pooled in loader:
        lat, emb, pooled = lat.to(device), emb.to(device), pooled.to(device)
        # fixed noise/timesteps so that validation numbers are comparable across evals
        noise = torch.randn(lat.shape, generator=g, device=device)
        sig = torch.sigmoid(torch.randn(lat.shape[0], generator=g, device=device)).view(-1, 1, 1, 1)
        pred = model(hidden_states=(1 - sig) * lat + sig * noise, timestep=sig.flatten() * 1000.0,
                     encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0]
        tot[0] += ((pred.float() - (noise - lat)) ** 2).mean(dim=(1, 2, 3)).sum()
        tot[1] += lat.shape[0]
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_full(model, path, rank):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(sd, path)
        logger.info("saved %s", path)
    dist.barrier()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="stabilityai/stable-diffusion-3-medium-diffusers")
    p.add_argument("--data", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="out/sd3-ft")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--val-every", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=5000)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [r{rank}] %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(1000 + rank)

    model = SD3Transformer2DModel.from_pretrained(args.base, subfolder="transformer")
    model.enable_gradient_checkpointing()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={JointTransformerBlock})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))

    train_ds, val_ds = CachedLatents(args.data), CachedLatents(args.val)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))
    logger.info("train %d samples, %d steps/epoch, world %d", len(train_ds), len(loader), world)

    step, epoch = 0, 0
    running, n_running = 0.0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for lat, emb, pooled in loader:
            lat = lat.to(device, non_blocking=True)
            emb = emb.to(device, non_blocking=True)
            pooled = pooled.to(device, non_blocking=True)

            loss = flow_loss(model, lat, emb, pooled)
            if not torch.isfinite(loss):
                logger.warning("non-finite loss at step %d, skipping batch", step)
                optimizer.zero_grad(set_to_none=True)
                continue
            loss.backward()
            grad_norm = model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            running += loss.item()
            n_running += 1

            if step % 25 == 0:
                logger.info("step %d loss %.4f gnorm %.3f lr %.2e", step, running / n_running,
                            grad_norm.item(), sched.get_last_lr()[0])
                running, n_running = 0.0, 0
            if step % args.val_every == 0:
                vloss = validate(model, val_loader, device)
                logger.info("step %d val_loss %.5f", step, vloss)
            if step % args.save_every == 0:
                save_full(model, os.path.join(args.out, f"transformer_{step:06d}.pt"), rank)
            if step >= args.steps:
                break
        epoch += 1

    save_full(model, os.path.join(args.out, "transformer_final.pt"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
