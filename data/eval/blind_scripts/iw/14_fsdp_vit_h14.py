#!/usr/bin/env python3
"""ViT-H/14 supervised pre-training on ImageNet-21k with FSDP (FULL_SHARD, bf16).

The 632M-parameter model plus AdamW state does not fit comfortably with DDP at this
batch size, so parameters, gradients and optimizer state are sharded. Activation
checkpointing on every transformer block.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        14_fsdp_vit_h14.py --data /fsx/in21k
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.models.vision_transformer import Block


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/fsx/in21k")
    ap.add_argument("--model", default="vit_huge_patch14_224")
    ap.add_argument("--num-classes", type=int, default=21841)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 4096")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--ckpt", default="/fsx/ckpt/vit_h14_in21k.pt")
    return ap.parse_args()


def no_decay(name):
    # names, not shapes: with use_orig_params the local view of a sharded tensor can be empty
    return name.endswith(".bias") or "norm" in name or name.endswith(("cls_token", "pos_embed"))


def save_full(model, optimizer, epoch, path, rank):
    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, optim_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd, "epoch": epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load_full(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu", mmap=True)
    load_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, load_cfg, optim_cfg):
        model.load_state_dict(ckpt["model"])
        osd = FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optimizer"])
        optimizer.load_state_dict(osd)
    return ckpt["epoch"] + 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    n_batches = torch.tensor(len(loader), device=device)
    dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
    it = iter(loader)
    # FSDP forward all-gathers parameters, so every rank must run the same number of forwards
    for _ in range(int(n_batches.item())):
        batch = next(it, None)
        if batch is None:
            x = torch.zeros(1, 3, 224, 224, device=device)
            y = None
        else:
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        logits = model(x)
        if y is not None:
            s[0] += (logits.argmax(-1) == y).sum()
            s[1] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)  # identical init on every rank before sharding

    t_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               interpolation="bicubic")
    t_val = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), t_train)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), t_val)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=args.num_classes, drop_path_rate=0.2)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 use_orig_params=True, limit_all_gathers=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                       checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    lr = args.lr * args.batch_size * world / 4096
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    nodecay = [p for n, p in model.named_parameters() if no_decay(n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": nodecay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    steps = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps,
                                                pct_start=args.warmup_epochs / args.epochs,
                                                anneal_strategy="cos", div_factor=1e3, final_div_factor=1e2)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()

    start_epoch = 0
    if os.path.exists(args.ckpt):
        start_epoch = load_full(model, optimizer, args.ckpt)
        for _ in range(start_epoch * steps):
            sched.step()
    if rank == 0:
        print(f"{world} ranks, global batch {args.batch_size * world}, peak lr {lr:.2e}, start {start_epoch}",
              flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            loss = criterion(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} {i}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)

        top1 = evaluate(model, val_loader, device)
        save_full(model, optimizer, epoch, args.ckpt, rank)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "val_top1": top1, "minutes": (time.time() - t0) / 60}),
                  flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
