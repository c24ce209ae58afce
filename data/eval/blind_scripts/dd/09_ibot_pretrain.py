"""iBOT: masked image modeling with an online tokenizer (self-distillation on [CLS] and patch tokens)."""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torchvision import datasets, transforms as T


def get_args():
    p = argparse.ArgumentParser("iBOT")
    p.add_argument("--data_path", default="/data/imagenet/train")
    p.add_argument("--output_dir", default="./ibot_vits16")
    p.add_argument("--out_dim", default=8192, type=int)
    p.add_argument("--patch_out_dim", default=8192, type=int)
    p.add_argument("--lambda1", default=1.0, type=float)
    p.add_argument("--lambda2", default=1.0, type=float)
    p.add_argument("--pred_ratio", default=0.3, type=float)
    p.add_argument("--pred_ratio_var", default=0.2, type=float)
    p.add_argument("--momentum_teacher", default=0.996, type=float)
    p.add_argument("--teacher_temp", default=0.07, type=float)
    p.add_argument("--teacher_patch_temp", default=0.07, type=float)
    p.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    p.add_argument("--warmup_teacher_temp_epochs", default=30, type=int)
    p.add_argument("--batch_size_per_gpu", default=64, type=int)
    p.add_argument("--epochs", default=800, type=int)
    p.add_argument("--lr", default=5e-4, type=float)
    p.add_argument("--min_lr", default=2e-6, type=float)
    p.add_argument("--warmup_epochs", default=10, type=int)
    p.add_argument("--weight_decay", default=0.04, type=float)
    p.add_argument("--weight_decay_end", default=0.4, type=float)
    p.add_argument("--clip_grad", default=3.0, type=float)
    p.add_argument("--local_crops_number", default=10, type=int)
    p.add_argument("--num_workers", default=10, type=int)
    p.add_argument("--saveckp_freq", default=40, type=int)
    p.add_argument("--seed", default=0, type=int)
    return p.parse_args()


class iBOTAug:
    def __init__(self, n_local, grid=14, pred_ratio=0.3, pred_ratio_var=0.2):
        flip_color = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                                T.RandomGrayscale(p=0.2)])
        norm = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        blur = lambda p: T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=p)
        self.g1 = T.Compose([T.RandomResizedCrop(224, scale=(0.32, 1.0), interpolation=3), flip_color, blur(1.0), norm])
        self.g2 = T.Compose([T.RandomResizedCrop(224, scale=(0.32, 1.0), interpolation=3), flip_color, blur(0.1),
                             T.RandomSolarize(128, p=0.2), norm])
        self.loc = T.Compose([T.RandomResizedCrop(96, scale=(0.05, 0.32), interpolation=3), flip_color, blur(0.5), norm])
        self.n_local, self.grid = n_local, grid
        self.pred_ratio, self.pred_ratio_var = pred_ratio, pred_ratio_var

    def random_mask(self):
        ratio = random.uniform(self.pred_ratio - self.pred_ratio_var, self.pred_ratio + self.pred_ratio_var)
        n = self.grid * self.grid
        mask = torch.zeros(n, dtype=torch.bool)
        mask[torch.randperm(n)[:int(n * ratio)]] = True
        return mask.view(self.grid, self.grid)

    def __call__(self, img):
        crops = [self.g1(img), self.g2(img)] + [self.loc(img) for _ in range(self.n_local)]
        masks = [self.random_mask(), self.random_mask()]
        return crops, masks


class MaskedViT(VisionTransformer):
    def __init__(self, **kw):
        super().__init__(num_classes=0, dynamic_img_size=True, **kw)
        self.masked_embed = nn.Parameter(torch.zeros(1, self.embed_dim))

    def forward(self, x, mask=None):
        x = self.patch_embed(x)
        if mask is not None:
            B, H, W, C = x.shape
            x = torch.where(mask.unsqueeze(-1), self.masked_embed.to(x.dtype).view(1, 1, 1, C), x)
        x = self._pos_embed(x)
        x = self.norm_pre(x)
        x = self.blocks(x)
        return self.norm(x)


class iBOTHead(nn.Module):
    def __init__(self, in_dim, out_dim, patch_out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False
        assert out_dim == patch_out_dim  # shared head for [CLS] and patches

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1)
        x = self.last_layer(x)
        return x[:, 0], x[:, 1:]


class StudentTeacher(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops, masks=None):
        n_global = 2
        g = torch.cat(crops[:n_global])
        g_mask = torch.cat(masks) if masks is not None else None
        cls_g, patch_g = self.head(self.backbone(g, g_mask))
        if len(crops) > n_global:
            cls_l, _ = self.head(self.backbone(torch.cat(crops[n_global:])))
            cls_g = torch.cat([cls_g, cls_l])
        return cls_g, patch_g


class iBOTLoss(nn.Module):
    def __init__(self, out_dim, patch_out_dim, ngcrops, nlcrops, warmup_t, t, t_patch, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9, lambda1=1.0, lambda2=1.0):
        super().__init__()
        self.student_temp, self.center_momentum = student_temp, center_momentum
        self.ngcrops, self.ncrops = ngcrops, ngcrops + nlcrops
        self.lambda1, self.lambda2 = lambda1, lambda2
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("center2", torch.zeros(1, 1, patch_out_dim))
        self.teacher_temp_schedule = np.concatenate((np.linspace(warmup_t, t, warmup_epochs),
                                                     np.ones(nepochs - warmup_epochs) * t))
        self.teacher_patch_temp = t_patch

    def forward(self, student_out, teacher_out, masks, epoch):
        s_cls, s_patch = student_out
        t_cls, t_patch = teacher_out
        temp = self.teacher_temp_schedule[epoch]
        s_cls_c = (s_cls / self.student_temp).chunk(self.ncrops)
        s_patch_c = (s_patch / self.student_temp).chunk(self.ngcrops)
        t_cls_c = F.softmax((t_cls - self.center) / temp, dim=-1).detach().chunk(self.ngcrops)
        t_patch_c = F.softmax((t_patch - self.center2) / self.teacher_patch_temp, dim=-1).detach().chunk(self.ngcrops)
        mask_c = masks.flatten(1).chunk(self.ngcrops)
        loss1, n1, loss2, n2 = 0, 0, 0, 0
        for q in range(self.ngcrops):
            for v in range(self.ncrops):
                if v == q:
                    m = mask_c[v].float()
                    l2 = torch.sum(-t_patch_c[q] * F.log_softmax(s_patch_c[v], dim=-1), dim=-1)
                    loss2 += ((l2 * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
                    n2 += 1
                else:
                    loss1 += torch.sum(-t_cls_c[q] * F.log_softmax(s_cls_c[v], dim=-1), dim=-1).mean()
                    n1 += 1
        self.update_center(t_cls, t_patch)
        return self.lambda1 * loss1 / n1 + self.lambda2 * loss2 / n2

    @torch.no_grad()
    def update_center(self, t_cls, t_patch):
        cls_center = torch.sum(t_cls, dim=0, keepdim=True)
        patch_center = torch.sum(t_patch.mean(1), dim=0, keepdim=True)
        dist.all_reduce(cls_center)
        dist.all_reduce(patch_center)
        ws = dist.get_world_size()
        self.center = self.center * self.center_momentum + cls_center / (len(t_cls) * ws) * (1 - self.center_momentum)
        self.center2 = self.center2 * self.center_momentum + \
            patch_center.unsqueeze(1) / (len(t_patch) * ws) * (1 - self.center_momentum)


def cosine_scheduler(base, final, epochs, niter, warmup_epochs=0):
    warm = np.linspace(0, base, warmup_epochs * niter) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter - len(warm))
    return np.concatenate((warm, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    dataset = datasets.ImageFolder(args.data_path, transform=iBOTAug(args.local_crops_number, 14,
                                                                      args.pred_ratio, args.pred_ratio_var))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                         num_workers=args.num_workers, pin_memory=True, drop_last=True)

    vit_kw = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    student = StudentTeacher(MaskedViT(drop_path_rate=0.1, **vit_kw),
                             iBOTHead(384, args.out_dim, args.patch_out_dim)).cuda()
    teacher = StudentTeacher(MaskedViT(**vit_kw), iBOTHead(384, args.out_dim, args.patch_out_dim)).cuda()
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    criterion = iBOTLoss(args.out_dim, args.patch_out_dim, 2, args.local_crops_number, args.warmup_teacher_temp,
                         args.teacher_temp, args.teacher_patch_temp, args.warmup_teacher_temp_epochs, args.epochs,
                         lambda1=args.lambda1, lambda2=args.lambda2).cuda()
    reg = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim > 1]
    noreg = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": reg}, {"params": noreg, "weight_decay": 0.0}])
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.output_dir, exist_ok=True)
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["fp16_scaler"])
        criterion.load_state_dict(ckpt["ibot_loss"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed from epoch {start_epoch}")

    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])

    niter = len(loader)
    lr_sched = cosine_scheduler(args.lr * args.batch_size_per_gpu * world / 256., args.min_lr, args.epochs, niter,
                                args.warmup_epochs)
    wd_sched = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    mom_sched = cosine_scheduler(args.momentum_teacher, 1.0, args.epochs, niter)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0, meter = time.time(), torch.zeros(2, device="cuda")
        for i, (crops, masks) in enumerate(loader):
            it = epoch * niter + i
            for j, g in enumerate(optimizer.param_groups):
                g["lr"] = lr_sched[it]
                if j == 0:
                    g["weight_decay"] = wd_sched[it]
            crops = [c.cuda(non_blocking=True) for c in crops]
            masks = [m.cuda(non_blocking=True) for m in masks]
            with torch.cuda.amp.autocast():
                teacher_out = teacher(crops[:2])
                student_out = student(crops, masks)
                loss = criterion(student_out, teacher_out, torch.cat(masks), epoch)
            if not math.isfinite(loss.item()):
                print(f"Loss is {loss.item()}, stopping training", flush=True)
                raise SystemExit(1)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                m = mom_sched[it]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.data.mul_(m).add_(ps.detach().data, alpha=1 - m)
            meter += torch.stack([loss.detach().float(), torch.ones((), device="cuda")])
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{niter}] loss {loss.item():.4f} lr {lr_sched[it]:.2e} m {m:.5f}", flush=True)

        dist.all_reduce(meter)
        if rank == 0:
            stats = {"epoch": epoch, "loss": (meter[0] / meter[1]).item(), "time": time.time() - t0}
            print(json.dumps(stats), flush=True)
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(stats) + "\n")
            state = {"student": student.state_dict(), "teacher": teacher.state_dict(),
                     "optimizer": optimizer.state_dict(), "fp16_scaler": scaler.state_dict(),
                     "ibot_loss": criterion.state_dict(), "epoch": epoch + 1, "args": vars(args)}
            torch.save(state, ckpt_path)
            if args.saveckp_freq and (epoch + 1) % args.saveckp_freq == 0:
                torch.save(state, os.path.join(args.output_dir, f"checkpoint{epoch:04}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
