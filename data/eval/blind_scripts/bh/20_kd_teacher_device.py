"""Online knowledge distillation: frozen timm teacher -> MobileNetV3-Large student on ImageNet.

RMSProp-free recipe: SGD + nesterov, label-smoothed CE + temperature KL, warm-up + cosine per step,
EMA of the student weights for evaluation.

    torchrun --nproc_per_node=8 20_kd_teacher_device.py --data /datasets/imagenet \
        --teacher convnext_base.fb_in22k_ft_in1k --teacher-weights /models/convnext_base_in22k_ft.pth
"""
import argparse
import copy
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", default="convnext_base.fb_in22k_ft_in1k")
    p.add_argument("--teacher-weights", required=True)
    p.add_argument("--student", default="mobilenetv3_large_100")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.2, help="at a global batch of 1024")
    p.add_argument("--wd", type=float, default=4e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--kd-ratio", type=float, default=0.5)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--output", default="output/kd_mnv3")
    return p.parse_args()


def load_teacher(name, weights_path, device="cuda:0"):
    model = timm.create_model(name, pretrained=False, num_classes=1000)
    sd = torch.load(weights_path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    model.load_state_dict(sd)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device)


def build_loaders(args, rank, world):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                 transforms.Normalize(mean, std)])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val, list(range(rank, len(val), world))), batch_size=250,
                            num_workers=args.workers, pin_memory=True)
    return sampler, train_loader, val_loader


class KDLoss(nn.Module):
    def __init__(self, T, ratio, smoothing):
        super().__init__()
        self.T, self.ratio = T, ratio
        self.ce = nn.CrossEntropyLoss(label_smoothing=smoothing)

    def forward(self, s, t, y):
        kd = F.kl_div(F.log_softmax(s / self.T, 1), F.softmax(t / self.T, 1), reduction="batchmean") * self.T ** 2
        return (1 - self.ratio) * self.ce(s, y) + self.ratio * kd


@torch.no_grad()
def ema_update(ema, model, decay):
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.dtype.is_floating_point:
            e.mul_(decay).add_(m.detach(), alpha=1 - decay)
        else:
            e.copy_(m)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        acc[0] += (pred == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sampler, train_loader, val_loader = build_loaders(args, rank, world)

    teacher = load_teacher(args.teacher, args.teacher_weights)
    student = timm.create_model(args.student, pretrained=False, num_classes=1000).to(device)
    student_ema = copy.deepcopy(student).eval().requires_grad_(False)
    student = DDP(student, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 1024
    params_wd, params_no_wd = [], []
    for n, p in student.module.named_parameters():
        (params_no_wd if p.ndim <= 1 else params_wd).append(p)
    optimizer = torch.optim.SGD([{"params": params_wd, "weight_decay": args.wd},
                                 {"params": params_no_wd, "weight_decay": 0.0}],
                                lr=lr, momentum=0.9, nesterov=True)
    steps = len(train_loader)
    total, warm = args.epochs * steps, args.warmup_epochs * steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    criterion = KDLoss(args.T, args.kd_ratio, args.smoothing)

    start_epoch = 0
    ckpt_file = os.path.join(args.output, "last.pth")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        student_ema.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"teacher {args.teacher} -> student {args.student}; {world} GPUs, lr {lr:.3f}", flush=True)

    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
            loss = criterion(s_logits.float(), t_logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            ema_update(student_ema, student.module, args.ema_decay)

            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.4f} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        acc = evaluate(student.module, val_loader, device)
        acc_ema = evaluate(student_ema, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top-1 {acc:.2f}  ema top-1 {acc_ema:.2f}", flush=True)
            ck = {"student": student.module.state_dict(), "ema": student_ema.state_dict(),
                  "optimizer": optimizer.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ck, ckpt_file)
            if acc_ema > best:
                best = acc_ema
                torch.save(student_ema.state_dict(), os.path.join(args.output, "best_ema.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
