"""DINO pre-training of a ViT-S/16 (timm backbone) with 2 global + 10 local crops.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29400 \
        11_dino_vit_multicrop.py --data /mnt/lustre/imagenet/train --output-dir /mnt/lustre/exp/dino_vits16
"""
import argparse
import datetime
import json
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.transforms import InterpolationMode


def get_args():
    p = argparse.ArgumentParser("DINO ViT")
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--arch", default="vit_small_patch16_224")
    p.add_argument("--out-dim", type=int, default=65536)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--momentum-teacher", type=float, default=0.996)
    p.add_argument("--warmup-teacher-temp", type=float, default=0.04)
    p.add_argument("--teacher-temp", type=float, default=0.07)
    p.add_argument("--warmup-teacher-temp-epochs", type=int, default=30)
    p.add_argument("--batch-size-per-gpu", type=int, default=64)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--freeze-last-layer", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4, help="peak lr at batch 256")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.04)
    p.add_argument("--weight-decay-end", type=float, default=0.4)
    p.add_argument("--clip-grad", type=float, default=3.0)
    p.add_argument("--local-crops-number", type=int, default=10)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--saveckp-freq", type=int, default=20)
    return p.parse_args()


class MultiCropAug:
    def __init__(self, n_local):
        flip_color = transforms.Compose([
            transforms.RandomHorizontalFlip(),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2)])
        norm = transforms.Compose([transforms.ToTensor(),
                                   transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        blur = transforms.GaussianBlur(23, (0.1, 2.0))
        rrc = lambda size, scale: transforms.RandomResizedCrop(size, scale=scale,
                                                               interpolation=InterpolationMode.BICUBIC)
        self.g1 = transforms.Compose([rrc(224, (0.32, 1.0)), flip_color, blur, norm])
        self.g2 = transforms.Compose([rrc(224, (0.32, 1.0)), flip_color, transforms.RandomApply([blur], p=0.1),
                                      transforms.RandomSolarize(128, p=0.2), norm])
        self.loc = transforms.Compose([rrc(96, (0.05, 0.32)), flip_color, transforms.RandomApply([blur], p=0.5), norm])
        self.n_local = n_local

    def __call__(self, img):
        return [self.g1(img), self.g2(img)] + [self.loc(img) for _ in range(self.n_local)]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256, norm_last_layer=True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.apply(self._init_weights)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        sizes = torch.tensor([inp.shape[-1] for inp in x])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops.tolist():
            feats.append(self.backbone(torch.cat(x[start:end])))
            start = end
        return self.head(torch.cat(feats))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_t, t, warmup_epochs, epochs, student_temp=0.1, center_m=0.9):
        super().__init__()
        self.ncrops, self.student_temp, self.center_m = ncrops, student_temp, center_m
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.t_sched = np.concatenate((np.linspace(warmup_t, t, warmup_epochs), np.ones(epochs - warmup_epochs) * t))

    def forward(self, s_out, t_out, epoch):
        s = (s_out / self.student_temp).chunk(self.ncrops)
        t = F.softmax((t_out - self.center) / self.t_sched[epoch], dim=-1).detach().chunk(2)
        loss, n = 0.0, 0
        for iq, q in enumerate(t):
            for v in range(len(s)):
                if v == iq:
                    continue
                loss = loss + torch.sum(-q * F.log_softmax(s[v], dim=-1), dim=-1).mean()
                n += 1
        self.update_center(t_out)
        return loss / n

    @torch.no_grad()
    def update_center(self, t_out):
        batch_center = t_out.sum(dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / (len(t_out) * dist.get_world_size())
        self.center = self.center * self.center_m + batch_center * (1 - self.center_m)


def cosine_scheduler(base, final, epochs, niter, warmup_epochs=0, start_warmup=0.0):
    warmup = np.linspace(start_warmup, base, warmup_epochs * niter) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter - len(warmup))
    return np.concatenate((warmup, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))))


def param_groups(model):
    reg, no_reg = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_reg if n.endswith(".bias") or p.ndim == 1 else reg).append(p)
    return [{"params": reg}, {"params": no_reg, "weight_decay": 0.0}]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)

    dataset = datasets.ImageFolder(args.data, transform=MultiCropAug(args.local_crops_number))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                         num_workers=args.workers, pin_memory=True, drop_last=True)

    def vit(drop_path):
        return timm.create_model(args.arch, pretrained=False, num_classes=0, dynamic_img_size=True,
                                 drop_path_rate=drop_path)

    student_bb, teacher_bb = vit(args.drop_path), vit(0.0)
    embed_dim = student_bb.num_features
    student = MultiCropWrapper(student_bb, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher = MultiCropWrapper(teacher_bb, DINOHead(embed_dim, args.out_dim)).cuda()
    # ViT has no batch norm, so the teacher stays a plain module; it is only ever updated by EMA
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    teacher.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    optimizer = torch.optim.AdamW(param_groups(student))
    scaler = torch.cuda.amp.GradScaler()

    niter = len(loader)
    lr_sched = cosine_scheduler(args.lr * args.batch_size_per_gpu * world / 256.0, args.min_lr,
                                args.epochs, niter, warmup_epochs=args.warmup_epochs)
    wd_sched = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    mom_sched = cosine_scheduler(args.momentum_teacher, 1.0, args.epochs, niter)

    start_epoch = 0
    ckpt_file = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        dino_loss.load_state_dict(ck["dino_loss"])
        start_epoch = ck["epoch"]

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for it, (images, _) in enumerate(loader):
            gi = niter * epoch + it
            for i, g in enumerate(optimizer.param_groups):
                g["lr"] = lr_sched[gi]
                if i == 0:
                    g["weight_decay"] = wd_sched[gi]
            images = [im.cuda(non_blocking=True) for im in images]

            with torch.cuda.amp.autocast():
                with torch.no_grad():
                    t_out = teacher(images[:2])
                s_out = student(images)
                loss = dino_loss(s_out.float(), t_out.float(), epoch)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            if epoch < args.freeze_last_layer:
                # the output layer is kept fixed during the first epoch (DINO trick)
                for n, p in student.named_parameters():
                    if "last_layer" in n:
                        p.grad = None
            scaler.step(optimizer)
            scaler.update()

            with torch.no_grad():
                m = mom_sched[gi]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.data.mul_(m).add_((1 - m) * ps.detach().data)

            if it % 100 == 0:
                loss_log = loss.detach()
                dist.all_reduce(loss_log, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("loss", loss_log.item(), gi)
                    writer.add_scalar("lr", lr_sched[gi], gi)
                    writer.add_scalar("wd", wd_sched[gi], gi)
                    print(f"[{epoch}][{it}/{niter}] loss {loss_log.item():.4f} lr {lr_sched[gi]:.2e} "
                          f"({(time.time() - t0) / (it + 1):.2f}s/it)", flush=True)

        if rank == 0:
            save = {"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                    "dino_loss": dino_loss.state_dict(), "epoch": epoch + 1, "args": vars(args)}
            torch.save(save, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
            if (epoch + 1) % args.saveckp_freq == 0:
                torch.save(teacher.backbone.state_dict(),
                           os.path.join(args.output_dir, f"teacher_backbone_{epoch + 1:04d}.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
