"""MoCo v2 on ImageNet-100 (ResNet-50), torchrun launcher, AMP, resumable.

    torchrun --nproc_per_node=8 17_moco_v2_resume.py --data /datasets/imagenet100 --out runs/moco_in100
    # after a pre-emption:
    torchrun --nproc_per_node=8 17_moco_v2_resume.py --data /datasets/imagenet100 --out runs/moco_in100 \
        --resume runs/moco_in100/last.pth
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.03, help="lr per 256 images")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queue", type=int, default=16384)
    p.add_argument("--m", type=float, default=0.999)
    p.add_argument("--t", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-interval", type=int, default=50)
    return p


@torch.no_grad()
def gather_no_grad(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def make_encoder(dim):
    net = torchvision.models.resnet50()
    hidden = net.fc.in_features
    net.fc = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))
    return net


class MoCoV2(nn.Module):
    def __init__(self, dim, K, m, T):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.q_enc = make_encoder(dim)
        self.k_enc = make_encoder(dim)
        self.k_enc.load_state_dict(self.q_enc.state_dict())
        self.k_enc.requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(K, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def momentum_update(self):
        for pq, pk in zip(self.q_enc.parameters(), self.k_enc.parameters()):
            pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)

    @torch.no_grad()
    def keys(self, x):
        # shuffle BN: each GPU normalises a random slice of the global batch
        n_local = x.size(0)
        x_all = gather_no_grad(x)
        perm = torch.randperm(x_all.size(0), device=x.device)
        dist.broadcast(perm, src=0)
        mine = perm.view(dist.get_world_size(), -1)[dist.get_rank()]
        k = F.normalize(self.k_enc(x_all[mine]), dim=1)
        k_all = gather_no_grad(k)
        inv = torch.argsort(perm)
        return k_all[inv.view(dist.get_world_size(), -1)[dist.get_rank()]], n_local

    @torch.no_grad()
    def enqueue(self, k):
        k = gather_no_grad(k)
        p = int(self.ptr)
        self.queue[p:p + k.size(0)] = k
        self.ptr.fill_((p + k.size(0)) % self.K)

    def forward(self, xq, xk):
        q = F.normalize(self.q_enc(xq), dim=1)
        self.momentum_update()
        k, _ = self.keys(xk)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone().t()
        logits = torch.cat([l_pos, l_neg], 1).float() / self.T
        self.enqueue(k)
        return logits


class Blur:
    def __call__(self, img):
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class TwoView:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.queue % (args.batch_size * world) == 0, "queue size must be a multiple of the global batch"

    aug = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([Blur()], p=0.5),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoView(aug))
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MoCoV2(args.dim, args.queue, args.m, args.t).cuda()
    model = DDP(model, device_ids=[local_rank])
    base_lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    n_iter = len(loader)
    total_iter = args.epochs * n_iter
    warm_iter = args.warmup_epochs * n_iter

    def lr_at(it):
        if it < warm_iter:
            return base_lr * (it + 1) / warm_iter
        return base_lr * 0.5 * (1 + math.cos(math.pi * (it - warm_iter) / (total_iter - warm_iter)))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {args.resume}, epoch {start_epoch}")

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_epoch = time.time()
        for i, ((xq, xk), _) in enumerate(loader):
            it = epoch * n_iter + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(it)
            xq, xk = xq.cuda(non_blocking=True), xk.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(xq, xk)
            labels = torch.zeros(logits.size(0), dtype=torch.long, device=logits.device)
            loss = F.cross_entropy(logits, labels)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if i % args.log_interval == 0:
                acc = (logits.argmax(1) == 0).float().mean() * 100
                s = torch.stack([loss.detach(), acc])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", s[0].item(), it)
                    writer.add_scalar("train/inst_acc", s[1].item(), it)
                    writer.add_scalar("train/lr", lr_at(it), it)
                    print(f"ep {epoch} [{i}/{n_iter}] loss {s[0].item():.3f} inst-acc {s[1].item():.1f}", flush=True)

        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t_epoch:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch + 1}
            torch.save(state, os.path.join(args.out, "last.pth.tmp"))
            os.replace(os.path.join(args.out, "last.pth.tmp"), os.path.join(args.out, "last.pth"))
            if (epoch + 1) % 100 == 0:
                torch.save(model.module.q_enc.state_dict(), os.path.join(args.out, f"q_enc_ep{epoch + 1}.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
