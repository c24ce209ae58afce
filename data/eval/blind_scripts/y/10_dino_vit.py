# DINO self-distillation, ViT-S/16, multi-crop.
# Usage: torchrun --nproc_per_node=8 main_dino_small.py --data_path /data/imagenet/train --output_dir out/dino_vits16
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
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops):
        # crops of the same resolution go through the backbone together
        sizes = torch.tensor([c.shape[-1] for c in crops])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops:
            feats.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(feats))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(nepochs - warmup_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total, n = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n += 1
        self.update_center(teacher_output)
        return total / n

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / (len(teacher_output) * dist.get_world_size())
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class GaussianBlur:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        if random.random() > self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class DataAugmentationDINO:
    def __init__(self, local_crops_number=6):
        flip_color = transforms.Compose([
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2)])
        norm = transforms.Compose([transforms.ToTensor(),
                                   transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.g1 = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), flip_color,
                                      GaussianBlur(1.0), norm])
        self.g2 = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), flip_color,
                                      GaussianBlur(0.1), transforms.RandomSolarize(128, p=0.2), norm])
        self.local = transforms.Compose([transforms.RandomResizedCrop(96, scale=(0.05, 0.4)), flip_color,
                                         GaussianBlur(0.5), norm])
        self.n_local = local_crops_number

    def __call__(self, image):
        return [self.g1(image), self.g2(image)] + [self.local(image) for _ in range(self.n_local)]


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup = np.linspace(start_warmup_value, base, warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def get_args():
    p = argparse.ArgumentParser("DINO")
    p.add_argument("--data_path", required=True)
    p.add_argument("--output_dir", default=".")
    p.add_argument("--out_dim", type=int, default=65536)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch_size_per_gpu", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.0005, help="at a global batch of 256")
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--warmup_epochs", type=int, default=10)
    p.add_argument("--weight_decay", type=float, default=0.04)
    p.add_argument("--weight_decay_end", type=float, default=0.4)
    p.add_argument("--momentum_teacher", type=float, default=0.996)
    p.add_argument("--warmup_teacher_temp", type=float, default=0.04)
    p.add_argument("--teacher_temp", type=float, default=0.04)
    p.add_argument("--warmup_teacher_temp_epochs", type=int, default=30)
    p.add_argument("--freeze_last_layer", type=int, default=1)
    p.add_argument("--local_crops_number", type=int, default=6)
    p.add_argument("--clip_grad", type=float, default=3.0)
    p.add_argument("--num_workers", type=int, default=10)
    p.add_argument("--saveckp_freq", type=int, default=20)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    np.random.seed(0)

    dataset = datasets.ImageFolder(args.data_path, transform=DataAugmentationDINO(args.local_crops_number))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                             num_workers=args.num_workers, pin_memory=True, drop_last=True)
    if rank == 0:
        print(f"Data loaded: {len(dataset)} images, {len(data_loader)} iters/epoch on {world} GPUs")

    student_backbone = timm.create_model("vit_small_patch16_224", num_classes=0, drop_path_rate=0.1, dynamic_img_size=True)
    teacher_backbone = timm.create_model("vit_small_patch16_224", num_classes=0, dynamic_img_size=True)
    embed_dim = student_backbone.num_features
    student = MultiCropWrapper(student_backbone, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher = MultiCropWrapper(teacher_backbone, DINOHead(embed_dim, args.out_dim)).cuda()
    student = DDP(student, device_ids=[local_rank])
    teacher.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                         args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs).cuda()

    regularized = [p for n, p in student.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    not_regularized = [p for n, p in student.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
    scaler = torch.cuda.amp.GradScaler()

    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size_per_gpu * world / 256.0, args.min_lr,
                                   args.epochs, niter, warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)

    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        start_epoch = ckpt["epoch"]

    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        student.train()
        loss_meter = torch.zeros(2, device="cuda")
        for it, (images, _) in enumerate(data_loader):
            it_global = niter * epoch + it
            for i, g in enumerate(optimizer.param_groups):
                g["lr"] = lr_schedule[it_global]
                if i == 0:
                    g["weight_decay"] = wd_schedule[it_global]
            images = [im.cuda(non_blocking=True) for im in images]

            with torch.cuda.amp.autocast():
                teacher_output = teacher(images[:2])
                student_output = student(images)
                loss = dino_loss(student_output, teacher_output, epoch)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            if epoch < args.freeze_last_layer:
                for n, p in student.named_parameters():
                    if "last_layer" in n:
                        p.grad = None
            scaler.step(optimizer)
            scaler.update()

            with torch.no_grad():
                m = momentum_schedule[it_global]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.data.mul_(m).add_((1 - m) * ps.detach().data)

            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
            if it % 50 == 0:
                cur = loss.detach().clone()
                dist.all_reduce(cur, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"Epoch [{epoch}/{args.epochs}] it [{it}/{niter}] loss {cur.item():.4f} "
                          f"lr {lr_schedule[it_global]:.6f} wd {wd_schedule[it_global]:.4f}", flush=True)

        dist.all_reduce(loss_meter)
        if rank == 0:
            print(f"epoch {epoch} avg loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"elapsed {(time.time() - start) / 3600:.2f}h")
            save = {"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                    "dino_loss": dino_loss.state_dict(), "epoch": epoch + 1, "args": args}
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save(save, ckpt_path)
            if args.saveckp_freq and (epoch + 1) % args.saveckp_freq == 0:
                torch.save(save, os.path.join(args.output_dir, f"checkpoint{epoch + 1:04}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
