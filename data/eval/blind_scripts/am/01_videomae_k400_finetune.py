#!/usr/bin/env python
"""Fine-tune a VideoMAE ViT-B/16 encoder on Kinetics-400 (16 frames, stride 4).

Launch with torchrun, one process per GPU.
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.models.layers import DropPath, trunc_normal_
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


# --------------------------------------------------------------------------- model
class PatchEmbed3D(nn.Module):
    def __init__(self, img_size=224, patch_size=16, tubelet=2, in_chans=3, dim=768, num_frames=16):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2 * (num_frames // tubelet)
        self.proj = nn.Conv3d(in_chans, dim, kernel_size=(tubelet, patch_size, patch_size),
                              stride=(tubelet, patch_size, patch_size))

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop_path(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VideoViT(nn.Module):
    def __init__(self, num_classes=400, dim=768, depth=12, heads=12, num_frames=16,
                 drop_path_rate=0.1, fc_drop=0.5):
        super().__init__()
        self.patch_embed = PatchEmbed3D(dim=dim, num_frames=num_frames)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(dim, heads, drop_path=dpr[i]) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc_dropout = nn.Dropout(fc_drop)
        self.head = nn.Linear(dim, num_classes)
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.head.weight, std=0.02)
        self.head.weight.data.mul_(0.001)

    def get_num_layers(self):
        return len(self.blocks)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed"}

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed.type_as(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.fc_norm(x.mean(1))
        return self.head(self.fc_dropout(x))


def get_layer_id(name, num_layers):
    if name.startswith(("pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def get_param_groups(model, weight_decay, skip_list, layer_scales):
    groups = {}
    num_layers = len(layer_scales) - 2
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or name.endswith(".bias") or name in skip_list
        lid = get_layer_id(name, num_layers)
        key = f"layer_{lid}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": layer_scales[lid]}
        groups[key]["params"].append(p)
    return list(groups.values())


# --------------------------------------------------------------------------- data
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


class KineticsClips(Dataset):
    """Reads `<relpath> <label>` lines; on a decode error falls back to another video."""

    def __init__(self, root, list_file, num_frames=16, stride=4, size=224, train=True):
        self.root, self.num_frames, self.stride, self.size, self.train = root, num_frames, stride, size, train
        with open(list_file) as f:
            self.items = [(p, int(l)) for p, l in (line.split() for line in f if line.strip())]

    def __len__(self):
        return len(self.items)

    def _decode(self, path):
        vr = VideoReader(path, num_threads=1, ctx=cpu(0))
        span = self.num_frames * self.stride
        n = len(vr)
        if self.train:
            start = np.random.randint(0, max(n - span, 0) + 1)
        else:
            start = max(n - span, 0) // 2
        idx = np.clip(np.arange(start, start + span, self.stride), 0, n - 1)
        frames = torch.from_numpy(vr.get_batch(idx).asnumpy())  # T H W C
        return frames.permute(3, 0, 1, 2).float().div_(255.0)

    def _spatial(self, clip):
        _, _, h, w = clip.shape
        if self.train:
            scale = np.random.uniform(0.5, 1.0)
            ch, cw = int(h * scale), int(w * scale)
            y, x = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
            clip = clip[:, :, y:y + ch, x:x + cw]
            if np.random.rand() < 0.5:
                clip = clip.flip(-1)
        clip = F.interpolate(clip, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return (clip - MEAN) / STD

    def __getitem__(self, i):
        for _ in range(10):
            path, label = self.items[i]
            try:
                return self._spatial(self._decode(os.path.join(self.root, path))), label
            except Exception:
                i = np.random.randint(len(self.items))
        raise RuntimeError("too many consecutive decode failures")


# --------------------------------------------------------------------------- utils
def cosine_lr(step, total, warmup, base_lr, min_lr):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    t = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for clips, labels in loader:
        clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(clips)
        top5 = logits.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == labels).sum()
        stats[1] += (top5 == labels[:, None]).any(1).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def parse_args():
    p = argparse.ArgumentParser("VideoMAE fine-tuning")
    p.add_argument("--data-root", required=True)
    p.add_argument("--train-list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--finetune", default="", help="pretrained encoder checkpoint")
    p.add_argument("--output-dir", default="./output/k400_vitb")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum-iter", type=int, default=1)
    p.add_argument("--epochs", type=int, default=75)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--blr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--model-ema-decay", type=float, default=0.9999)
    p.add_argument("--num-workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)
    np.random.seed(0 + rank)
    torch.backends.cudnn.benchmark = True

    train_set = KineticsClips(args.data_root, args.train_list, train=True)
    val_set = KineticsClips(args.data_root, args.val_list, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=2 * args.batch_size, num_workers=args.num_workers,
                            pin_memory=True)

    model = VideoViT(num_classes=400)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        state = {k.replace("encoder.", ""): v for k, v in ckpt["model"].items() if k.startswith("encoder.")}
        msg = model.load_state_dict(state, strict=False)
        if rank == 0:
            print("loaded pretrained encoder:", msg)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV2(model_without_ddp, decay=args.model_ema_decay)

    eff_batch = args.batch_size * args.accum_iter * world
    lr = args.blr * eff_batch / 256
    num_layers = model_without_ddp.get_num_layers()
    layer_scales = [args.layer_decay ** (num_layers + 1 - i) for i in range(num_layers + 2)]
    param_groups = get_param_groups(model_without_ddp, args.weight_decay, model.no_weight_decay(), layer_scales)
    optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=400)
    criterion = SoftTargetCrossEntropy()

    steps_per_epoch = len(train_loader) // args.accum_iter
    total_steps, warmup_steps = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch

    start_epoch, best_top1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        model_ema.module.load_state_dict(ckpt["model_ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt.get("best_top1", 0.0)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} eff_batch={eff_batch} lr={lr:.2e} steps/epoch={steps_per_epoch}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0, running = time.time(), torch.zeros(2, device=device)
        for it, (clips, labels) in enumerate(train_loader):
            clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            clips, targets = mixup_fn(clips, labels)
            step = epoch * steps_per_epoch + it // args.accum_iter
            if it % args.accum_iter == 0:
                cur = cosine_lr(step, total_steps, warmup_steps, lr, args.min_lr)
                for g in optimizer.param_groups:
                    g["lr"] = cur * g["lr_scale"]
            update = (it + 1) % args.accum_iter == 0
            with torch.cuda.amp.autocast():
                loss = criterion(model(clips), targets) / args.accum_iter
            if update:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                model_ema.update(model_without_ddp)
            else:
                with model.no_sync():
                    scaler.scale(loss).backward()
            running += torch.stack([loss.detach() * args.accum_iter, torch.ones((), device=device)])
            if it % 50 == 0:
                snap = running.clone()
                dist.all_reduce(snap)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{len(train_loader)} loss {(snap[0] / snap[1]).item():.4f} "
                          f"lr {optimizer.param_groups[-1]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)

        top1, top5 = evaluate(model_without_ddp, val_loader, device)
        ema_top1, _ = evaluate(model_ema.module, val_loader, device)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "top1": top1, "top5": top5, "ema_top1": ema_top1}), flush=True)
            best_top1 = max(best_top1, top1)
            torch.save({"model": model_without_ddp.state_dict(), "model_ema": model_ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best_top1": best_top1, "args": vars(args)},
                       os.path.join(args.output_dir, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
