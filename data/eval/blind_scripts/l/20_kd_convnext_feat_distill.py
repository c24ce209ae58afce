"""
Knowledge distillation ConvNeXt-Base (teacher, frozen) -> ConvNeXt-Tiny (student) on an
ImageNet-format folder. Logit KD every step; the (more expensive) feature-alignment loss
through a 1x1 projector is only added every --feat_every steps.

torchrun --standalone --nproc_per_node=8 20_kd_convnext_feat_distill.py \
    --data /data/imagenet --teacher_ckpt weights/convnext_base_ft.pt --epochs 100
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class Student(nn.Module):
    def __init__(self, num_classes, teacher_dim=1024):
        super().__init__()
        net = models.convnext_tiny(weights=models.ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
        self.features = net.features
        self.pool = net.avgpool
        self.head = net.classifier
        self.head[2] = nn.Linear(self.head[2].in_features, num_classes)
        self.proj = nn.Sequential(nn.Conv2d(768, teacher_dim, 1, bias=False),
                                  nn.GroupNorm(32, teacher_dim))

    def forward(self, x, return_feat=False):
        f = self.features(x)
        logits = self.head(self.pool(f))
        if return_feat:
            return logits, self.proj(f)
        return logits, None


def teacher_model(num_classes, ckpt):
    t = models.convnext_base()
    t.classifier[2] = nn.Linear(t.classifier[2].in_features, num_classes)
    t.load_state_dict(torch.load(ckpt, map_location="cpu"))
    return t.eval().requires_grad_(False)


def kd_loss(s_logits, t_logits, T):
    return F.kl_div(F.log_softmax(s_logits / T, -1), F.softmax(t_logits / T, -1),
                    reduction="batchmean") * T * T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher_ckpt", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument("--feat_w", type=float, default=1.0)
    p.add_argument("--feat_every", type=int, default=4)
    p.add_argument("--out", default="runs/kd_tiny")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(), transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    num_classes = len(train_ds.classes)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    val_dl = DataLoader(val_shard, batch_size=256, num_workers=6, pin_memory=True)

    teacher = teacher_model(num_classes, args.teacher_ckpt).to(device, memory_format=torch.channels_last)
    student = Student(num_classes).to(device, memory_format=torch.channels_last)
    model = DDP(student, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    iters = len(train_dl) * args.epochs
    warm = 5 * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda i: (i + 1) / warm if i < warm else 0.5 * (1 + math.cos(math.pi * (i - warm) / (iters - warm))))

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            use_feat = args.feat_w > 0 and step % args.feat_every == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_feat = teacher.features(x)
                    t_logits = teacher.classifier(teacher.avgpool(t_feat))
                s_logits, s_feat = model(x, return_feat=use_feat)
                loss = (args.alpha * kd_loss(s_logits.float(), t_logits.float(), args.T)
                        + (1 - args.alpha) * F.cross_entropy(s_logits.float(), y))
                if use_feat:
                    loss = loss + args.feat_w * F.mse_loss(s_feat.float(), t_feat.float())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

        # top-1 of the student on the full val set
        student.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.to(device, memory_format=torch.channels_last), y.to(device)
                logits, _ = student(x)
                c[0] += (logits.argmax(1) == y).sum()
                c[1] += y.numel()
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val top1 {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": student.state_dict(), "epoch": epoch, "top1": acc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
