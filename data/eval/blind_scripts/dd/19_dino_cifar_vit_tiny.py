"""DINO on CIFAR-100 with a ViT-Tiny/4 (32px global crops, 16px local crops) + k-NN eval on the test set."""
import argparse
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

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./dino_cifar100")
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=256, help="per GPU")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--wd", type=float, default=0.04)
    parser.add_argument("--wd_end", type=float, default=0.4)
    parser.add_argument("--out_dim", type=int, default=16384)
    parser.add_argument("--n_local", type=int, default=8)
    parser.add_argument("--teacher_temp", type=float, default=0.04)
    parser.add_argument("--momentum", type=float, default=0.996)
    parser.add_argument("--knn_every", type=int, default=20)
    return parser.parse_args()


class MultiCrop:
    def __init__(self, n_local):
        cj = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                        T.RandomGrayscale(0.2)])
        nrm = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
        self.g = T.Compose([T.RandomResizedCrop(32, (0.3, 1.0)), cj, T.RandomSolarize(128, 0.1), nrm])
        self.l = T.Compose([T.RandomResizedCrop(16, (0.05, 0.3)), cj, nrm])
        self.n_local = n_local

    def __call__(self, img):
        return [self.g(img), self.g(img)] + [self.l(img) for _ in range(self.n_local)]


class DINOHead(nn.Module):
    def __init__(self, dim, out_dim, hidden=1024, bottleneck=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class Model(nn.Module):
    def __init__(self, drop_path=0.0, out_dim=16384):
        super().__init__()
        self.backbone = VisionTransformer(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3,
                                          num_classes=0, drop_path_rate=drop_path, dynamic_img_size=True)
        self.head = DINOHead(192, out_dim)

    def forward(self, crops):
        feats = [self.backbone(torch.cat(crops[:2]))]
        if len(crops) > 2:
            feats.append(self.backbone(torch.cat(crops[2:])))
        return self.head(torch.cat(feats))


def dino_loss(s_out, t_out, center, ncrops, t_temp, s_temp=0.1):
    s = (s_out / s_temp).chunk(ncrops)
    t = F.softmax((t_out - center) / t_temp, dim=-1).detach().chunk(2)
    total, n = 0.0, 0
    for iq, q in enumerate(t):
        for v in range(ncrops):
            if v == iq:
                continue
            total = total + (-q * F.log_softmax(s[v], dim=-1)).sum(-1).mean()
            n += 1
    return total / n


@torch.no_grad()
def update_center(center, t_out, m=0.9):
    bc = t_out.sum(0, keepdim=True)
    dist.all_reduce(bc)
    bc /= len(t_out) * dist.get_world_size()
    center.mul_(m).add_(bc, alpha=1 - m)


@torch.no_grad()
def knn_accuracy(backbone, train_set, test_set, device, k=20):
    # CIFAR is small: the whole train / test set is embedded here, no communication needed
    backbone.eval()
    def embed(ds):
        dl = torch.utils.data.DataLoader(ds, batch_size=1024, num_workers=4)
        fs, ys = [], []
        for x, y in dl:
            fs.append(F.normalize(backbone(x.to(device)), dim=1))
            ys.append(y.to(device))
        return torch.cat(fs), torch.cat(ys)
    ftr, ytr = embed(train_set)
    fte, yte = embed(test_set)
    correct = 0
    for i in range(0, len(fte), 1000):
        sim, idx = (fte[i:i + 1000] @ ftr.T).topk(k, dim=1)
        votes = torch.zeros(sim.shape[0], 100, device=device).scatter_add_(1, ytr[idx], (sim / 0.07).exp())
        correct += (votes.argmax(1) == yte[i:i + 1000]).sum().item()
    backbone.train()
    return 100.0 * correct / len(fte)


def cosine(base, final, epochs, niter, warmup=0):
    w = np.linspace(0, base, warmup * niter)
    r = np.arange(epochs * niter - len(w))
    return np.concatenate([w, final + 0.5 * (base - final) * (1 + np.cos(np.pi * r / len(r)))])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_ssl = datasets.CIFAR100(args.data, train=True, transform=MultiCrop(args.n_local))
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train_eval = datasets.CIFAR100(args.data, train=True, transform=eval_tf)
    test_eval = datasets.CIFAR100(args.data, train=False, transform=eval_tf)

    sampler = torch.utils.data.DistributedSampler(train_ssl, shuffle=True)
    loader = torch.utils.data.DataLoader(train_ssl, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                                         pin_memory=True, drop_last=True)

    student = Model(drop_path=0.1, out_dim=args.out_dim).to(device)
    teacher = Model(out_dim=args.out_dim).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    student = nn.parallel.DistributedDataParallel(student, device_ids=[args.local_rank])
    center = torch.zeros(1, args.out_dim, device=device)

    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1]},
                             {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}])
    niter = len(loader)
    lr_s = cosine(args.lr * args.batch_size * world / 256, args.min_lr, args.epochs, niter, args.warmup)
    wd_s = cosine(args.wd, args.wd_end, args.epochs, niter)
    m_s = cosine(args.momentum, 1.0, args.epochs, niter)
    ncrops = 2 + args.n_local

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for i, (crops, _) in enumerate(loader):
            it = epoch * niter + i
            opt.param_groups[0].update(lr=lr_s[it], weight_decay=wd_s[it])
            opt.param_groups[1].update(lr=lr_s[it])
            crops = [c.to(device, non_blocking=True) for c in crops]
            with torch.no_grad():
                t_out = teacher(crops[:2])
            s_out = student(crops)
            loss = dino_loss(s_out, t_out, center, ncrops, args.teacher_temp)
            update_center(center, t_out)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(student.parameters(), 3.0)
            opt.step()
            with torch.no_grad():
                m = m_s[it]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.mul_(m).add_(ps.detach(), alpha=1 - m)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(run)
        msg = f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)"
        if rank == 0 and ((epoch + 1) % args.knn_every == 0 or epoch + 1 == args.epochs):
            msg += f" knn@20 {knn_accuracy(teacher.backbone, train_eval, test_eval, device):.2f}"
        if rank == 0:
            print(msg, flush=True)
            torch.save({"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "center": center.cpu(), "optimizer": opt.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
