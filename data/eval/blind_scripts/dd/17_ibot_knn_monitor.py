"""iBOT-style pre-training (ViT-S/16) with a k-NN accuracy monitor on the full ImageNet val set every few epochs."""
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
from timm.models.vision_transformer import VisionTransformer
from torchvision import datasets, transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--out", default="./ibot_s16")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--bs", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--wd", type=float, default=0.04)
    p.add_argument("--wd_end", type=float, default=0.4)
    p.add_argument("--out_dim", type=int, default=8192)
    p.add_argument("--n_local", type=int, default=10)
    p.add_argument("--mask_ratio", type=float, default=0.3)
    p.add_argument("--tm", type=float, default=0.996)
    p.add_argument("--knn_every", type=int, default=10)
    p.add_argument("--knn_k", type=int, default=20)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


NORM = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class Aug:
    def __init__(self, n_local, grid=14, ratio=0.3):
        cj = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                        T.RandomGrayscale(0.2)])
        blur = lambda p: T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=p)
        self.g1 = T.Compose([T.RandomResizedCrop(224, (0.32, 1.0), interpolation=3), cj, blur(1.0), T.ToTensor(), NORM])
        self.g2 = T.Compose([T.RandomResizedCrop(224, (0.32, 1.0), interpolation=3), cj, blur(0.1),
                             T.RandomSolarize(128, 0.2), T.ToTensor(), NORM])
        self.lc = T.Compose([T.RandomResizedCrop(96, (0.05, 0.32), interpolation=3), cj, blur(0.5), T.ToTensor(), NORM])
        self.n_local, self.grid, self.ratio = n_local, grid, ratio

    def mask(self):
        n = self.grid * self.grid
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.randperm(n)[:int(n * self.ratio)]] = True
        return m.view(self.grid, self.grid)

    def __call__(self, img):
        crops = [self.g1(img), self.g2(img)] + [self.lc(img) for _ in range(self.n_local)]
        return crops, torch.stack([self.mask(), self.mask()])


class IndexedFolder(datasets.ImageFolder):
    def __getitem__(self, i):
        img, _ = super().__getitem__(i)
        return img, i


class ViT(VisionTransformer):
    def __init__(self, **kw):
        super().__init__(num_classes=0, dynamic_img_size=True, **kw)
        self.mask_emb = nn.Parameter(torch.zeros(1, 1, 1, self.embed_dim))

    def forward(self, x, mask=None, return_all=False):
        x = self.patch_embed(x)
        if mask is not None:
            x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = self.norm(self.blocks(self._pos_embed(x)))
        return x if return_all else x[:, 0]


class Head(nn.Module):
    def __init__(self, dim, out_dim, hidden=2048, bottleneck=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last = nn.utils.weight_norm(nn.Linear(bottleneck, out_dim, bias=False))
        self.last.weight_g.data.fill_(1)
        self.last.weight_g.requires_grad = False

    def forward(self, x):
        return self.last(F.normalize(self.mlp(x), dim=-1))


class Net(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, globals_, masks=None, locals_=None):
        tok = self.head(self.backbone(globals_, masks, return_all=True))
        cls, patch = tok[:, 0], tok[:, 1:]
        if locals_ is not None:
            cls = torch.cat([cls, self.head(self.backbone(locals_))])
        return cls, patch


class Centering(nn.Module):
    def __init__(self, dim, m=0.9):
        super().__init__()
        self.m = m
        self.register_buffer("c_cls", torch.zeros(1, dim))
        self.register_buffer("c_patch", torch.zeros(1, 1, dim))

    @torch.no_grad()
    def update(self, t_cls, t_patch):
        s = torch.cat([t_cls.sum(0), t_patch.mean(1).sum(0), torch.tensor([float(len(t_cls))], device=t_cls.device)])
        dist.all_reduce(s)
        d = t_cls.shape[1]
        n = s[-1]
        self.c_cls = self.c_cls * self.m + (s[:d] / n)[None] * (1 - self.m)
        self.c_patch = self.c_patch * self.m + (s[d:2 * d] / n)[None, None] * (1 - self.m)


def ibot_loss(s_cls, s_patch, t_cls, t_patch, masks, center, n_crops, t_temp=0.07, s_temp=0.1):
    tc = F.softmax((t_cls - center.c_cls) / t_temp, -1).chunk(2)
    tp = F.softmax((t_patch - center.c_patch) / t_temp, -1).chunk(2)
    sc = (s_cls / s_temp).chunk(n_crops)
    sp = (s_patch / s_temp).chunk(2)
    mk = masks.flatten(1).float().chunk(2)
    l_cls, l_patch = 0.0, 0.0
    for q in range(2):
        for v in range(n_crops):
            if v == q:
                lp = (-tp[q] * F.log_softmax(sp[v], -1)).sum(-1)
                l_patch = l_patch + ((lp * mk[v]).sum(-1) / mk[v].sum(-1).clamp(min=1)).mean()
            else:
                l_cls = l_cls + (-tc[q] * F.log_softmax(sc[v], -1)).sum(-1).mean()
    center.update(t_cls, t_patch)
    return l_cls / (2 * n_crops - 2) + l_patch / 2


@torch.no_grad()
def knn_eval(backbone, train_loader, val_loader, train_labels, k, n_train, device, world):
    backbone.eval()
    bank = None
    # the train loader uses a padded DistributedSampler, so every rank runs the same number of
    # equally sized batches and the all_gathers line up; the sample index removes the duplicates
    for imgs, idx in train_loader:
        f = F.normalize(backbone(imgs.to(device, non_blocking=True)).float(), dim=1)
        idx = idx.to(device)
        if bank is None:
            bank = torch.zeros(n_train, f.shape[1], device=device)
        fs = [torch.empty_like(f) for _ in range(world)]
        ids = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(fs, f)
        dist.all_gather(ids, idx)
        bank.index_copy_(0, torch.cat(ids), torch.cat(fs))

    # val: strided shard per rank, no collectives inside the loop
    hits = torch.zeros(2, device=device, dtype=torch.float64)
    for imgs, tgt in val_loader:
        f = F.normalize(backbone(imgs.to(device, non_blocking=True)).float(), dim=1)
        tgt = tgt.to(device)
        sim, nn_idx = (f @ bank.T).topk(k, dim=1)
        w = (sim / 0.07).exp()
        votes = torch.zeros(f.shape[0], 1000, device=device).scatter_add_(1, train_labels[nn_idx], w)
        hits[0] += (votes.argmax(1) == tgt).sum()
        hits[1] += tgt.numel()
    dist.all_reduce(hits)
    return (100.0 * hits[0] / hits[1]).item()


def cosine(base, final, epochs, niter, warmup=0):
    w = np.linspace(0, base, warmup * niter)
    r = np.arange(epochs * niter - len(w))
    return np.concatenate([w, final + 0.5 * (base - final) * (1 + np.cos(np.pi * r / len(r)))])


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), Aug(args.n_local, 14, args.mask_ratio))
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True)
    loader = torch.utils.data.DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers,
                                         pin_memory=True, drop_last=True)
    eval_tf = T.Compose([T.Resize(256, interpolation=3), T.CenterCrop(224), T.ToTensor(), NORM])
    knn_train = IndexedFolder(os.path.join(args.data, "train"), eval_tf)
    knn_val = datasets.ImageFolder(os.path.join(args.data, "val"), eval_tf)
    knn_train_loader = torch.utils.data.DataLoader(
        knn_train, 256, sampler=torch.utils.data.DistributedSampler(knn_train, shuffle=False),
        num_workers=args.workers, pin_memory=True)
    knn_val_loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(knn_val, range(rank, len(knn_val), world)), 256,
        num_workers=args.workers, pin_memory=True)
    train_labels = torch.tensor(knn_train.targets, device=device)

    kw = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    student = Net(ViT(drop_path_rate=0.1, **kw), Head(384, args.out_dim)).to(device)
    teacher = Net(ViT(**kw), Head(384, args.out_dim)).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    center = Centering(args.out_dim).to(device)

    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1]},
                             {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}])
    scaler = torch.cuda.amp.GradScaler()
    niter = len(loader)
    lr_s = cosine(args.lr * args.bs * world / 256, args.min_lr, args.epochs, niter, args.warmup)
    wd_s = cosine(args.wd, args.wd_end, args.epochs, niter)
    m_s = cosine(args.tm, 1.0, args.epochs, niter)

    start = 0
    ck_path = os.path.join(args.out, "checkpoint.pth")
    if os.path.isfile(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        center.load_state_dict(ck["center"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    n_crops = 2 + args.n_local
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0, acc = time.time(), torch.zeros(2, device=device)
        for i, (crops, masks) in enumerate(loader):
            it = epoch * niter + i
            for j, g in enumerate(opt.param_groups):
                g["lr"] = lr_s[it]
                g["weight_decay"] = wd_s[it] if j == 0 else 0.0
            crops = [c.to(device, non_blocking=True) for c in crops]
            masks = masks.to(device, non_blocking=True).transpose(0, 1).flatten(0, 1)
            g_crops, l_crops = torch.cat(crops[:2]), torch.cat(crops[2:])
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_cls, t_patch = teacher(g_crops)
                s_cls, s_patch = student(g_crops, masks, l_crops)
                loss = ibot_loss(s_cls.float(), s_patch.float(), t_cls.float(), t_patch.float(), masks, center,
                                 n_crops)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(student.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                m = m_s[it]
                torch._foreach_mul_(list(teacher.parameters()), m)
                torch._foreach_add_(list(teacher.parameters()), [p.detach() for p in student.module.parameters()],
                                    alpha=1 - m)
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{niter}] loss {loss.item():.4f}", flush=True)

        dist.all_reduce(acc)
        log = {"epoch": epoch, "loss": (acc[0] / acc[1]).item(), "time": round(time.time() - t0)}
        if (epoch + 1) % args.knn_every == 0 or epoch + 1 == args.epochs:
            log["knn_top1"] = knn_eval(teacher.backbone, knn_train_loader, knn_val_loader, train_labels,
                                       args.knn_k, len(knn_train), device, world)
        if rank == 0:
            print(json.dumps(log), flush=True)
            with open(os.path.join(args.out, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            torch.save({"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "center": center.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch + 1}, ck_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
