"""MoCo v3 ViT-S/16 pre-training (frozen random patch projection) with a kNN monitor.

torchrun --nproc_per_node=8 12_moco_v3_vit_knn.py --data /datasets/imagenet --out runs/mocov3_vits
"""
import argparse
import math
import os
import random
import time
from functools import partial

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import ImageFilter, ImageOps
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/mocov3_vits")
    p.add_argument("--arch", default="vit_small_patch16_224")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=1024, help="total over all GPUs")
    p.add_argument("--blr", type=float, default=1.5e-4, help="lr = blr * batch_size / 256")
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--moco-m", type=float, default=0.99)
    p.add_argument("--moco-t", type=float, default=0.2)
    p.add_argument("--knn-every", type=int, default=20)
    p.add_argument("--knn-subset", type=int, default=100, help="train images per class in the kNN bank")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def mlp(n_layers, d_in, d_hidden, d_out, last_bn=True):
    layers = []
    for i in range(n_layers):
        a = d_in if i == 0 else d_hidden
        b = d_out if i == n_layers - 1 else d_hidden
        layers.append(nn.Linear(a, b, bias=False))
        if i < n_layers - 1:
            layers += [nn.BatchNorm1d(b), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(b, affine=False))
    return nn.Sequential(*layers)


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


class MoCoViT(nn.Module):
    def __init__(self, arch, dim=256, mlp_dim=4096, T=0.2):
        super().__init__()
        self.T = T
        self.base_encoder = timm.create_model(arch, num_classes=0, drop_path_rate=0.0)
        self.momentum_encoder = timm.create_model(arch, num_classes=0, drop_path_rate=0.0)
        width = self.base_encoder.num_features
        self.base_proj = mlp(3, width, mlp_dim, dim)
        self.momentum_proj = mlp(3, width, mlp_dim, dim)
        self.predictor = mlp(2, dim, mlp_dim, dim, last_bn=False)
        # random, fixed patch projection (stabilises ViT training)
        for p in self.base_encoder.patch_embed.parameters():
            p.requires_grad = False
        for (b, m) in ((self.base_encoder, self.momentum_encoder), (self.base_proj, self.momentum_proj)):
            m.load_state_dict(b.state_dict())
            for p in m.parameters():
                p.requires_grad = False

    @torch.no_grad()
    def _update_momentum(self, m):
        for b, mm in ((self.base_encoder, self.momentum_encoder), (self.base_proj, self.momentum_proj)):
            for pb, pm in zip(b.parameters(), mm.parameters()):
                pm.mul_(m).add_(pb.detach(), alpha=1 - m)

    def _loss(self, q, k):
        q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        k = concat_all_gather(k)
        logits = q @ k.T / self.T
        n = q.shape[0]
        labels = torch.arange(n, device=q.device) + n * dist.get_rank()
        return 2 * self.T * F.cross_entropy(logits, labels)

    def features(self, x):
        return self.base_encoder(x)

    def forward(self, x1, x2, m):
        q1 = self.predictor(self.base_proj(self.base_encoder(x1)))
        q2 = self.predictor(self.base_proj(self.base_encoder(x2)))
        with torch.no_grad():
            self._update_momentum(m)
            k1 = self.momentum_proj(self.momentum_encoder(x1))
            k2 = self.momentum_proj(self.momentum_encoder(x2))
        return self._loss(q1, k2) + self._loss(q2, k1)


class Blur:
    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class TwoViews:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __call__(self, x):
        return self.a(x), self.b(x)


def build_aug():
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    base = [T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], 0.8),
            T.RandomGrayscale(0.2)]
    v1 = T.Compose(base + [T.RandomApply([Blur()], 1.0), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    v2 = T.Compose(base + [T.RandomApply([Blur()], 0.1), T.RandomApply([T.Lambda(ImageOps.solarize)], 0.2),
                           T.RandomHorizontalFlip(), T.ToTensor(), norm])
    return TwoViews(v1, v2)


@torch.no_grad()
def embed_labeled(encoder, ds, device, workers):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=workers, pin_memory=True)
    f, y = [], []
    for x, t in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            f.append(F.normalize(encoder(x.to(device, non_blocking=True)).float(), dim=1))
        y.append(t.to(device))
    idx = torch.tensor(list(iter(sampler)), device=device)
    # the sampler pads every rank to the same length, so the gathered shapes match;
    # scattering by dataset index drops the padded repeats
    f, y, idx = concat_all_gather(torch.cat(f)), concat_all_gather(torch.cat(y)), concat_all_gather(idx)
    feats = torch.zeros(len(ds), f.shape[1], device=device)
    labels = torch.zeros(len(ds), dtype=torch.long, device=device)
    feats[idx], labels[idx] = f, y
    return feats, labels


@torch.no_grad()
def knn_top1(encoder, bank_ds, val_ds, n_cls, device, workers, k=20, t=0.07):
    encoder.eval()
    bank_f, bank_y = embed_labeled(encoder, bank_ds, device, workers)
    val_f, val_y = embed_labeled(encoder, val_ds, device, workers)
    rank, world = dist.get_rank(), dist.get_world_size()
    correct = torch.zeros(2, device=device)
    for chunk in torch.arange(rank, len(val_f), world, device=device).split(1024):
        s, i = (val_f[chunk] @ bank_f.T).topk(k, dim=1)
        votes = torch.zeros(len(chunk), n_cls, device=device).scatter_add_(1, bank_y[i], (s / t).exp())
        correct += torch.stack([(votes.argmax(1) == val_y[chunk]).sum().float(),
                                torch.tensor(float(len(chunk)), device=device)])
    dist.all_reduce(correct)
    encoder.train()
    return (100 * correct[0] / correct[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = MoCoViT(args.arch, T=args.moco_t)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    lr = args.blr * args.batch_size / 256
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr,
                            weight_decay=args.wd, betas=(0.9, 0.95))

    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), build_aug())
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                       T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    bank_full = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), plain)
    per_cls, keep = {}, []
    for i, (_, y) in enumerate(bank_full.samples):  # same deterministic subset on every rank
        if per_cls.get(y, 0) < args.knn_subset:
            per_cls[y] = per_cls.get(y, 0) + 1
            keep.append(i)
    bank_ds = torch.utils.data.Subset(bank_full, keep)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), plain)

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    ipe = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, stats = time.time(), torch.zeros(2, device=device)
        for i, ((x1, x2), _) in enumerate(loader):
            e = epoch + i / ipe
            cur_lr = lr * e / args.warmup_epochs if e < args.warmup_epochs else \
                lr * 0.5 * (1 + math.cos(math.pi * (e - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
            for g in opt.param_groups:
                g["lr"] = cur_lr
            m = 1 - 0.5 * (1 + math.cos(math.pi * e / args.epochs)) * (1 - args.moco_m)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(x1.to(device, non_blocking=True), x2.to(device, non_blocking=True), m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        msg = f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} lr {cur_lr:.2e} {time.time() - t0:.0f}s"
        if (epoch + 1) % args.knn_every == 0:
            msg += f" knn-top1 {knn_top1(model.base_encoder, bank_ds, val_ds, 1000, device, args.workers):.2f}"
        if rank == 0:
            print(msg, flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
