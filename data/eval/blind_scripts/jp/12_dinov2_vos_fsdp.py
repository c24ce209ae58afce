"""
DINOv2-L memory VOS model, fully fine-tuned with FSDP + activation checkpointing.

    torchrun --nproc_per_node=8 train_dinov2_vos_fsdp.py --data /data/vos_mix --davis /data/DAVIS \
        --out /nfs/exp/dinov2_vos [--resume /nfs/exp/dinov2_vos/last.pt]
"""
import argparse
import functools
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from timm.models.vision_transformer import Block
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--davis", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--size", type=int, default=518)
    p.add_argument("--clip_len", type=int, default=6)
    p.add_argument("--val_len", type=int, default=20)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--project", default="dinov2-vos")
    return p.parse_args()


def read_frame(path, size):
    im = torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((size, size), Image.BICUBIC))).permute(2, 0, 1).float() / 255
    return (im - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]


def read_mask(path, size):
    return np.array(Image.open(path).resize((size, size), Image.NEAREST))


class Clips(Dataset):
    def __init__(self, root, clip_len, size):
        self.root, self.clip_len, self.size = root, clip_len, size
        ann = os.path.join(root, "Annotations")
        self.videos = [(v, sorted(x[:-4] for x in os.listdir(os.path.join(ann, v)))) for v in sorted(os.listdir(ann))]
        self.videos = [(v, n) for v, n in self.videos if len(n) >= clip_len]

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        s = random.randint(0, len(names) - self.clip_len)
        sel = names[s:s + self.clip_len]
        frames = torch.stack([read_frame(os.path.join(self.root, "JPEGImages", v, n + ".jpg"), self.size) for n in sel])
        anns = np.stack([read_mask(os.path.join(self.root, "Annotations", v, n + ".png"), self.size) for n in sel])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return frames, torch.from_numpy((anns == o).astype(np.float32))


class DavisObjects(Dataset):
    def __init__(self, root, val_len, size):
        self.root, self.val_len, self.size = root, val_len, size
        self.items = []
        for seq in open(os.path.join(root, "ImageSets/2017/val.txt")).read().split():
            m0 = read_mask(os.path.join(root, "Annotations/480p", seq, "00000.png"), size)
            self.items += [(seq, int(o)) for o in np.unique(m0) if o != 0]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, o = self.items[i]
        names = sorted(os.listdir(os.path.join(self.root, "JPEGImages/480p", seq)))[: self.val_len]
        frames = torch.stack([read_frame(os.path.join(self.root, "JPEGImages/480p", seq, n), self.size) for n in names])
        anns = np.stack([read_mask(os.path.join(self.root, "Annotations/480p", seq, n[:-4] + ".png"), self.size) for n in names])
        return frames, torch.from_numpy((anns == o).astype(np.float32)), i


class MemoryBlock(nn.Module):
    def __init__(self, dim=256, heads=8):
        super().__init__()
        self.norm_q, self.norm_m, self.norm_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.cross = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mem):
        m = self.norm_m(mem)
        x = x + self.cross(self.norm_q(x), m, m, need_weights=False)[0]
        return x + self.ffn(self.norm_f(x))


class DinoVOS(nn.Module):
    def __init__(self, dim=256, n_blocks=3, max_mem=6):
        super().__init__()
        self.backbone = timm.create_model("vit_large_patch14_dinov2.lvd142m", pretrained=True, num_classes=0, dynamic_img_size=True)
        self.proj = nn.Linear(self.backbone.embed_dim, dim)
        self.mask_proj = nn.Conv2d(1, dim, 14, 14)
        self.mem_value = nn.Linear(2 * dim, dim)
        self.blocks = nn.ModuleList([MemoryBlock(dim) for _ in range(n_blocks)])
        self.head = nn.Sequential(nn.ConvTranspose2d(dim, 128, 2, 2), nn.GroupNorm(16, 128), nn.GELU(),
                                  nn.ConvTranspose2d(128, 32, 2, 2), nn.GELU(), nn.Conv2d(32, 1, 1))
        self.max_mem = max_mem

    def forward(self, frames, mask0):
        B, T, _, H, W = frames.shape
        h, w = H // 14, W // 14
        tok = self.proj(self.backbone.forward_features(frames.flatten(0, 1))[:, self.backbone.num_prefix_tokens:])
        tok = tok.unflatten(0, (B, T))
        m0 = self.mask_proj(mask0[:, None]).flatten(2).transpose(1, 2)
        bank = [self.mem_value(torch.cat([tok[:, 0], m0], -1))]
        outs = []
        for t in range(1, T):
            x = tok[:, t]
            mem = torch.cat(bank[:1] + bank[1:][-(self.max_mem - 1):], 1)
            for blk in self.blocks:
                x = blk(x, mem)
            logit = self.head(x.transpose(1, 2).reshape(B, -1, h, w))
            outs.append(F.interpolate(logit, size=(H, W), mode="bilinear", align_corners=False)[:, 0])
            mt = self.mask_proj(torch.sigmoid(outs[-1])[:, None]).flatten(2).transpose(1, 2)
            bank.append(self.mem_value(torch.cat([x, mt], -1)))
        return torch.stack(outs, 1)


def region_boundary(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def validate(model, val_set, device):
    # the padded sampler gives every rank the same number of forwards (FSDP needs all ranks in each one);
    # the duplicated items are dropped again by index below
    loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4)
    model.eval()
    local = {}
    for frames, masks, idx in loader:
        logits = model(frames.to(device), masks[:, 0].to(device))[0].float()
        pred = (logits > 0).cpu().numpy()
        gt = masks[0, 1:].numpy() > 0.5
        local[int(idx)] = tuple(np.mean([region_boundary(p, g) for p, g in zip(pred, gt)], axis=0))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    merged = {k: v for part in parts for k, v in part.items()}
    per_seq = {}
    for i, (j, f) in merged.items():
        per_seq.setdefault(val_set.items[i][0], []).append((j, f))
    js = [np.mean([x[0] for x in v]) for v in per_seq.values()]
    fs = [np.mean([x[1] for x in v]) for v in per_seq.values()]
    return float(np.mean(js)), float(np.mean(fs))


def save(model, opt, epoch, best, path, rank):
    # all ranks take part in gathering the full state; only rank 0 ends up holding it (on CPU)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "epoch": epoch, "best": best}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)

    net = DinoVOS()
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])

    model = FSDP(net,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, MemoryBlock}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32),
                 device_id=local_rank, use_orig_params=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, (Block, MemoryBlock)))

    backbone = [p for n, p in model.named_parameters() if "backbone." in n]
    rest = [p for n, p in model.named_parameters() if "backbone." not in n]
    opt = torch.optim.AdamW([{"params": backbone, "lr": args.lr * 0.1}, {"params": rest, "lr": args.lr}], weight_decay=0.05)
    start_epoch, best = 0, 0.0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        del ckpt

    train_set = Clips(args.data, args.clip_len, args.size)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_set = DavisObjects(args.davis, args.val_len, args.size)
    total_steps = args.epochs * len(loader)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.project, config=vars(args), resume="allow", name=os.path.basename(args.out))

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for frames, masks in loader:
            lr_scale = min(1.0, (step + 1) / 300) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = args.lr * 0.1 * lr_scale, args.lr * lr_scale
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            logits = model(frames, masks[:, 0]).float()
            target = masks[:, 1:]
            prob = logits.sigmoid()
            dice = 1 - (2 * (prob * target).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + target.flatten(2).sum(-1) + 1)
            loss = F.binary_cross_entropy_with_logits(logits, target) + dice.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1
            if rank == 0 and step % 25 == 0:
                wandb.log({"train/loss": loss.item(), "lr": opt.param_groups[1]["lr"], "step_time": (time.time() - t0) / 25}, step=step)
                t0 = time.time()

        j, f = validate(model, val_set, device)
        best = max(best, (j + f) / 2)
        if rank == 0:
            wandb.log({"val/J": j, "val/F": f, "val/J&F": (j + f) / 2, "epoch": epoch}, step=step)
            print(f"epoch {epoch}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f} best {best:.4f}", flush=True)
        save(model, opt, epoch, best, os.path.join(args.out, "last.pt"), rank)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
