"""SimCLR pretraining (ResNet-50) with LARS and a cross-GPU NT-Xent loss.

Negatives come from the whole global batch: projected embeddings are gathered
from every rank with the autograd-aware all_gather, so each GPU sees
2 * global_batch - 2 negatives per anchor.

    torchrun --nproc_per_node=8 09_simclr_lars.py --data /data/imagenet/train --batch-size 64
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, img):
        import random
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class TwoCrops:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return self.tf(x), self.tf(x)


def simclr_transform():
    color = transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)
    return transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomApply([color], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([GaussianBlur()], p=0.5),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])


class SimCLR(nn.Module):
    def __init__(self, proj_dim=128, hidden=2048):
        super().__init__()
        self.encoder = torchvision.models.resnet50()
        feat = self.encoder.fc.in_features
        self.encoder.fc = nn.Identity()
        self.projector = nn.Sequential(
            nn.Linear(feat, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False),
        )

    def forward(self, x):
        return self.projector(self.encoder(x))


def nt_xent(z1, z2, temperature, rank):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    z1_all = torch.cat(dist_fn.all_gather(z1), dim=0)
    z2_all = torch.cat(dist_fn.all_gather(z2), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    big_n = z1_all.size(0)
    mask = F.one_hot(labels, big_n).bool()
    logits_aa = (z1 @ z1_all.T / temperature).masked_fill(mask, -1e9)
    logits_bb = (z2 @ z2_all.T / temperature).masked_fill(mask, -1e9)
    logits_ab = z1 @ z2_all.T / temperature
    logits_ba = z2 @ z1_all.T / temperature
    loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)
    loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], dim=1), labels)
    return (loss_a + loss_b) / 2


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay=1e-6, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                                      exclude=False))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad
                if not g["exclude"]:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, g["eta"] * param_norm / update_norm, 1.0),
                                    1.0)
                    dp = dp.mul(q)
                st = self.state[p]
                if "mu" not in st:
                    st["mu"] = torch.zeros_like(p)
                mu = st["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=0.3, help="lr = base_lr * global_batch / 256")
    ap.add_argument("--wd", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--ckpt-dir", default="ckpt/simclr_r50")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = torchvision.datasets.ImageFolder(args.data, TwoCrops(simclr_transform()))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SimCLR().to(device)
    model = DDP(model, device_ids=[local_rank])

    params_lars, params_plain = [], []
    for name, p in model.module.named_parameters():
        (params_plain if p.ndim == 1 else params_lars).append(p)
    global_batch = args.batch_size * world
    lr = args.base_lr * global_batch / 256
    optimizer = LARS([{"params": params_lars}, {"params": params_plain, "exclude": True, "weight_decay": 0.0}],
                     lr=lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(loader)
    total, warmup = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    start_epoch = 0
    last_path = os.path.join(args.ckpt_dir, "last.pth")
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"global batch {global_batch}, peak lr {lr:.3f}, {steps_per_epoch} it/epoch")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            cur_lr = lr * (step + 1) / warmup if step < warmup else \
                lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                z = model(torch.cat([x1, x2], dim=0))
                z1, z2 = z.float().chunk(2)
            loss = nt_xent(z1, z2, args.temperature, rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.4f}")

        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, last_path)
            if (epoch + 1) % 20 == 0:
                torch.save(model.module.encoder.state_dict(),
                           os.path.join(args.ckpt_dir, f"encoder_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
