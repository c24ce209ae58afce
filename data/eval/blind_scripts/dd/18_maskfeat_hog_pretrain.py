# MaskFeat: predict HOG features of masked patches (ViT-B/16, block-wise masking, AdamW + cosine).
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from timm.models.vision_transformer import VisionTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.datasets import ImageFolder

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser("MaskFeat pre-training")
    ap.add_argument("--data", default="/datasets/imagenet/train")
    ap.add_argument("--out", default="./maskfeat_vitb")
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--warmup_epochs", type=int, default=30)
    ap.add_argument("--blr", type=float, default=2e-4)
    ap.add_argument("--weight_decay", type=float, default=0.05)
    ap.add_argument("--mask_ratio", type=float, default=0.4)
    ap.add_argument("--hog_bins", type=int, default=9)
    ap.add_argument("--hog_cell", type=int, default=8)
    ap.add_argument("--clip_grad", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--save_every", type=int, default=10)
    return ap.parse_args()


class HOGLayer(nn.Module):
    """Per-channel HOG (unsigned orientation, L2-normalised per 2x2 cell block) on un-normalised RGB."""

    def __init__(self, nbins=9, cell=8, patch=16):
        super().__init__()
        self.nbins, self.cell, self.patch = nbins, cell, patch
        gx = torch.tensor([[1, 0, -1], [2, 0, -2], [1, 0, -1]], dtype=torch.float32)
        self.register_buffer("weight_x", gx.view(1, 1, 3, 3).repeat(3, 1, 1, 1))
        self.register_buffer("weight_y", gx.t().contiguous().view(1, 1, 3, 3).repeat(3, 1, 1, 1))

    @torch.no_grad()
    def forward(self, x):
        x = F.pad(x, (1, 1, 1, 1), mode="reflect")
        gx = F.conv2d(x, self.weight_x, groups=3)
        gy = F.conv2d(x, self.weight_y, groups=3)
        mag = torch.sqrt(gx ** 2 + gy ** 2)
        phase = torch.atan2(gx, gy) / math.pi * self.nbins
        B, C, H, W = mag.shape
        out = torch.zeros(B, C, self.nbins, H, W, device=x.device, dtype=x.dtype)
        phase_int = phase.floor().long() % self.nbins
        out.scatter_(2, phase_int.unsqueeze(2), mag.unsqueeze(2))
        out = F.avg_pool2d(out.flatten(1, 2), self.cell, self.cell) * self.cell ** 2
        out = out.view(B, C, self.nbins, H // self.cell, W // self.cell)
        # group cells into patches: (B, C*nbins*k*k, H/patch, W/patch)
        k = self.patch // self.cell
        out = out.unfold(3, k, k).unfold(4, k, k)  # B, C, nb, h, w, k, k
        out = out.permute(0, 3, 4, 1, 2, 5, 6).flatten(3)
        out = F.normalize(out, dim=-1)
        return out.flatten(1, 2)  # B, L, C*nbins*k*k


class MaskFeatViT(VisionTransformer):
    def __init__(self, target_dim, **kw):
        super().__init__(num_classes=0, **kw)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.pred = nn.Linear(self.embed_dim, target_dim)

    def forward(self, x, mask):
        x = self.patch_embed(x)
        w = mask.unsqueeze(-1).to(x.dtype)
        x = x * (1 - w) + self.mask_token.to(x.dtype) * w
        x = self.norm(self.blocks(self._pos_embed(x)))
        return self.pred(x[:, 1:])


def block_mask(batch, grid, ratio, device):
    """Random block-wise masks of roughly `ratio` * grid^2 patches, one per sample."""
    n_target = int(grid * grid * ratio)
    masks = torch.zeros(batch, grid, grid, dtype=torch.bool, device=device)
    for b in range(batch):
        while masks[b].sum() < n_target:
            area = torch.randint(16, max(17, n_target // 2), (1,)).item()
            aspect = math.exp(torch.empty(1).uniform_(math.log(0.3), math.log(1 / 0.3)).item())
            h = min(grid, max(1, int(round(math.sqrt(area * aspect)))))
            w = min(grid, max(1, int(round(math.sqrt(area / aspect)))))
            top = torch.randint(0, grid - h + 1, (1,)).item()
            left = torch.randint(0, grid - w + 1, (1,)).item()
            masks[b, top:top + h, left:left + w] = True
    return masks.flatten(1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")

    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    ds = ImageFolder(args.data, T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), interpolation=3),
                                           T.RandomHorizontalFlip(), T.ToTensor()]))
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                                     pin_memory=True, drop_last=True, persistent_workers=True)

    hog = HOGLayer(args.hog_bins, args.hog_cell, 16).to(device)
    target_dim = 3 * args.hog_bins * (16 // args.hog_cell) ** 2
    model = MaskFeatViT(target_dim, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                        drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.blr * args.batch_size * world / 256
    decay = [p for n, p in model.module.named_parameters() if p.ndim > 1 and "token" not in n and "pos_embed" not in n]
    no_decay = [p for n, p in model.module.named_parameters() if not (p.ndim > 1 and "token" not in n
                                                                      and "pos_embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ck = os.path.join(args.out, "checkpoint.pth")
    if os.path.exists(ck):
        state = torch.load(ck, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1
        log.info(f"resumed from {ck} at epoch {start_epoch}")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    niter = len(dl)
    total, warm = args.epochs * niter, args.warmup_epochs * niter
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, meter = time.time(), torch.zeros(2, device=device)
        for i, (img, _) in enumerate(dl):
            step = epoch * niter + i
            cur = lr * step / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            img = img.to(device, non_blocking=True)
            mask = block_mask(img.shape[0], 14, args.mask_ratio, "cpu").to(device, non_blocking=True)
            target = hog(img)
            with torch.cuda.amp.autocast():
                pred = model((img - mean) / std, mask)
                loss = F.mse_loss(pred[mask].float(), target[mask])

            loss_value = loss.item()
            if not math.isfinite(loss_value):
                log.warning(f"non-finite loss ({loss_value}) at epoch {epoch} iter {i}, skipping batch")
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if i % 100 == 0:
                log.info(f"ep {epoch} [{i}/{niter}] loss {loss_value:.4f} lr {cur:.2e}")

        dist.all_reduce(meter)
        stats = {"epoch": epoch, "loss": (meter[0] / meter[1]).item(), "time": round(time.time() - t0)}
        log.info(json.dumps(stats))
        if rank == 0:
            with open(os.path.join(args.out, "log.txt"), "a") as f:
                f.write(json.dumps(stats) + "\n")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, ck)
            if (epoch + 1) % args.save_every == 0:
                torch.save(state, os.path.join(args.out, f"checkpoint-{epoch + 1:04d}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
