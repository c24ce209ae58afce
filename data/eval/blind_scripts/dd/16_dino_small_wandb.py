"""DINO ViT-S/16 on ImageNet-100 with Weights & Biases tracking."""
import argparse
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
from torchvision import datasets, transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", default="/data/imagenet100")
    p.add_argument("--output_dir", default="./runs/dino_in100")
    p.add_argument("--wandb_project", default="ssl-in100")
    p.add_argument("--run_name", default="dino_vits16_in100")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size_per_gpu", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--warmup_epochs", type=int, default=10)
    p.add_argument("--wd", type=float, default=0.04)
    p.add_argument("--wd_end", type=float, default=0.4)
    p.add_argument("--out_dim", type=int, default=65536)
    p.add_argument("--momentum_teacher", type=float, default=0.996)
    p.add_argument("--teacher_temp", type=float, default=0.04)
    p.add_argument("--n_local", type=int, default=6)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class Head(nn.Module):
    def __init__(self, in_dim, out_dim, hidden=2048, bottleneck=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class Wrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops):
        g = self.backbone(torch.cat(crops[:2]))
        if len(crops) > 2:
            g = torch.cat([g, self.backbone(torch.cat(crops[2:]))])
        return self.head(g)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, teacher_temp, student_temp=0.1, momentum=0.9):
        super().__init__()
        self.ncrops, self.tt, self.st, self.m = ncrops, teacher_temp, student_temp, momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, s, t):
        s = (s / self.st).chunk(self.ncrops)
        tq = F.softmax((t - self.center) / self.tt, dim=-1).detach().chunk(2)
        loss = sum(torch.sum(-q * F.log_softmax(s[v], dim=-1), dim=-1).mean()
                   for iq, q in enumerate(tq) for v in range(self.ncrops) if v != iq)
        loss = loss / (2 * self.ncrops - 2)
        with torch.no_grad():
            c = t.sum(0, keepdim=True)
            dist.all_reduce(c)
            self.center = self.center * self.m + c / (len(t) * dist.get_world_size()) * (1 - self.m)
        return loss


def aug(n_local):
    cj = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                    T.RandomGrayscale(0.2)])
    nrm = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    blur = lambda p: T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=p)
    g1 = T.Compose([T.RandomResizedCrop(224, (0.4, 1.0), interpolation=3), cj, blur(1.0), nrm])
    g2 = T.Compose([T.RandomResizedCrop(224, (0.4, 1.0), interpolation=3), cj, blur(0.1), T.RandomSolarize(128, 0.2), nrm])
    lc = T.Compose([T.RandomResizedCrop(96, (0.05, 0.4), interpolation=3), cj, blur(0.5), nrm])
    return lambda im: [g1(im), g2(im)] + [lc(im) for _ in range(n_local)]


def cosine(base, final, epochs, niter, warmup=0):
    w = np.linspace(0, base, warmup * niter)
    r = np.arange(epochs * niter - len(w))
    return np.concatenate([w, final + 0.5 * (base - final) * (1 + np.cos(np.pi * r / len(r)))])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(rank)
    torch.manual_seed(0)

    os.makedirs(args.output_dir, exist_ok=True)
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), dir=args.output_dir)

    ds = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=aug(args.n_local))
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size_per_gpu, sampler=sampler,
                                     num_workers=args.workers, pin_memory=True, drop_last=True)

    def vit(**kw):
        return timm.create_model("vit_small_patch16_224", num_classes=0, dynamic_img_size=True, **kw)

    student = Wrapper(vit(drop_path_rate=0.1), Head(384, args.out_dim)).cuda()
    teacher = Wrapper(vit(), Head(384, args.out_dim)).cuda()
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    criterion = DINOLoss(args.out_dim, args.n_local + 2, args.teacher_temp).cuda()

    named = [(n, p) for n, p in student.module.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if p.ndim > 1]},
                             {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0}])
    scaler = torch.cuda.amp.GradScaler()

    niter = len(dl)
    lr_s = cosine(args.lr * args.batch_size_per_gpu * world / 256, args.min_lr, args.epochs, niter, args.warmup_epochs)
    wd_s = cosine(args.wd, args.wd_end, args.epochs, niter)
    m_s = cosine(args.momentum_teacher, 1.0, args.epochs, niter)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0, agg = time.time(), torch.zeros(2, device="cuda")
        for i, (crops, _) in enumerate(dl):
            it = epoch * niter + i
            opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = lr_s[it]
            opt.param_groups[0]["weight_decay"] = wd_s[it]
            crops = [c.cuda(non_blocking=True) for c in crops]
            with torch.cuda.amp.autocast():
                t_out = teacher(crops[:2])
                s_out = student(crops)
                loss = criterion(s_out, t_out)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"loss is {loss.item()}")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gnorm = nn.utils.clip_grad_norm_(student.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                m = m_s[it]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.mul_(m).add_(ps.detach(), alpha=1 - m)
            agg += torch.stack([loss.detach().float(), torch.ones((), device="cuda")])
            if i % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": lr_s[it], "train/wd": wd_s[it],
                           "train/momentum": m, "train/grad_norm": gnorm.item()}, step=it)

        dist.all_reduce(agg)
        epoch_loss = (agg[0] / agg[1]).item()
        wandb.log({"epoch/loss": epoch_loss, "epoch/time": time.time() - t0, "epoch": epoch}, step=(epoch + 1) * niter)
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_loss:.4f}", flush=True)
            torch.save({"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": opt.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.output_dir, "checkpoint.pth"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
