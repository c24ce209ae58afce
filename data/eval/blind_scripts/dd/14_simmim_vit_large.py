# SimMIM pre-training of ViT-L/16 (192px) with activation checkpointing, bf16 autocast and
# layer-wise lr decay; a held-out reconstruction loss is computed on ImageNet-val every few epochs.
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from timm.models.vision_transformer import VisionTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torchvision.datasets import ImageFolder


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/imagenet")
    ap.add_argument("--out", default="./simmim_vitl")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--warmup_epochs", type=int, default=10)
    ap.add_argument("--base_lr", type=float, default=1e-4)
    ap.add_argument("--layer_decay", type=float, default=0.9)
    ap.add_argument("--weight_decay", type=float, default=0.05)
    ap.add_argument("--mask_ratio", type=float, default=0.6)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


class RandomBlockMask:
    def __init__(self, img=192, mask_patch=32, model_patch=16, ratio=0.6):
        self.g = img // mask_patch
        self.scale = mask_patch // model_patch
        self.n_mask = int(math.ceil(self.g * self.g * ratio))

    def __call__(self):
        m = torch.zeros(self.g * self.g)
        m[torch.randperm(self.g * self.g)[:self.n_mask]] = 1
        m = m.view(self.g, self.g)
        return m.repeat_interleave(self.scale, 0).repeat_interleave(self.scale, 1)


class WithMask:
    def __init__(self, tf, masker):
        self.tf, self.masker = tf, masker

    def __call__(self, img):
        return self.tf(img), self.masker()


class SimMIMViT(VisionTransformer):
    def __init__(self, **kw):
        super().__init__(num_classes=0, **kw)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.use_ckpt = True

    def forward(self, x, mask):
        x = self.patch_embed(x)
        B, L, C = x.shape
        w = mask.flatten(1).unsqueeze(-1).to(x.dtype)
        x = x * (1 - w) + self.mask_token.to(x.dtype) * w
        x = self._pos_embed(x)
        for blk in self.blocks:
            if self.use_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.norm(x)[:, 1:]
        h = int(L ** 0.5)
        return x.transpose(1, 2).reshape(B, C, h, h)


class SimMIM(nn.Module):
    def __init__(self, encoder, stride=16):
        super().__init__()
        self.encoder = encoder
        self.decoder = nn.Sequential(nn.Conv2d(encoder.embed_dim, stride ** 2 * 3, 1), nn.PixelShuffle(stride))
        self.stride = stride

    def forward(self, x, mask):
        rec = self.decoder(self.encoder(x, mask))
        m = mask.repeat_interleave(self.stride, 1).repeat_interleave(self.stride, 2).unsqueeze(1)
        l1 = F.l1_loss(rec.float(), x, reduction="none")
        return (l1 * m).sum() / (m.sum() + 1e-5) / 3


def layer_decay_groups(model, wd, layer_decay, base_lr):
    """Names are taken from the bare module (no 'module.' prefix)."""
    depth = len(model.encoder.blocks)
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("encoder.blocks."):
            lid = int(name.split(".")[2]) + 1
        elif name.startswith(("encoder.cls_token", "encoder.pos_embed", "encoder.patch_embed", "encoder.mask_token")):
            lid = 0
        else:
            lid = depth + 1
        no_wd = p.ndim == 1 or name.endswith((".cls_token", ".pos_embed", ".mask_token"))
        key = (lid, no_wd)
        if key not in groups:
            scale = layer_decay ** (depth + 1 - lid)
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd, "lr_scale": scale, "lr": base_lr * scale}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(img, mask)
        s[0] += loss.double() * img.shape[0]
        s[1] += img.shape[0]
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    np.random.seed(rank)

    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    masker = RandomBlockMask(192, 32, 16, args.mask_ratio)
    train_tf = T.Compose([T.RandomResizedCrop(192, scale=(0.67, 1.0), ratio=(3 / 4, 4 / 3)), T.RandomHorizontalFlip(),
                          T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(219, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(192), T.ToTensor(), norm])
    train_set = ImageFolder(os.path.join(args.data, "train"), WithMask(train_tf, masker))
    val_set = ImageFolder(os.path.join(args.data, "val"), WithMask(val_tf, masker))
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)
    # evaluation is a plain forward (no DDP), so shards of unequal length are fine
    val_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    enc = SimMIMViT(img_size=192, patch_size=16, embed_dim=1024, depth=24, num_heads=16, drop_path_rate=0.1)
    model = SimMIM(enc).to(device)
    base_lr = args.base_lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(layer_decay_groups(model, args.weight_decay, args.layer_decay, base_lr),
                                  lr=base_lr, betas=(0.9, 0.999))
    ddp_model = DDP(model, device_ids=[local_rank])

    ckpt_path = os.path.join(args.out, "last.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    steps = len(train_loader)
    total, warm = args.epochs * steps, args.warmup_epochs * steps
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for i, (img, mask) in enumerate(train_loader):
            step = epoch * steps + i
            f = step / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = base_lr * f * g["lr_scale"]
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp_model(img, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(ddp_model.parameters(), 5.0)
            optimizer.step()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{steps} loss {loss.item():.4f} gnorm {gn.item():.2f} "
                      f"lr {optimizer.param_groups[-1]['lr']:.2e}", flush=True)
        dist.all_reduce(run)
        msg = f"epoch {epoch} train {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)"

        if (epoch + 1) % args.eval_every == 0:
            msg += f" val {evaluate(model, val_loader, device):.4f}"

        if rank == 0:
            print(msg, flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
