#!/usr/bin/env python3
"""Knowledge distillation: ResNet-50 teacher -> MobileNetV3-Large student.

    python 12_spawn_logs_distill.py --data /data/imagenet --teacher ckpt/resnet50_teacher.pt --gpus 8

The same file launches itself: the launcher spawns one worker per GPU,
collects each worker's output in <out>/logs/rank<k>.log, and restarts the
group (resuming from <out>/student_last.pth) if it fails.
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/imagenet")
    p.add_argument("--teacher", default="ckpt/resnet50_teacher.pt")
    p.add_argument("--out", default="runs/kd_mnv3")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.064, help="RMSprop lr per 1024 images")
    p.add_argument("--T", type=float, default=4.0, help="distillation temperature")
    p.add_argument("--alpha", type=float, default=0.7, help="weight of the KD term")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def build_data(root, rank, world, batch, workers):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train = torchvision.datasets.ImageFolder(os.path.join(root, "train"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.TrivialAugmentWide(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(os.path.join(root, "val"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=batch, sampler=sampler, num_workers=workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=200,
                            num_workers=workers, pin_memory=True)
    return train_loader, val_loader, sampler


def kd_loss(student_logits, teacher_logits, target, T, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=1), F.softmax(teacher_logits / T, dim=1),
                    reduction="batchmean") * T * T
    hard = F.cross_entropy(student_logits, target)
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    res = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top5 = out.topk(5, dim=1).indices
        res[0] += (top5[:, 0] == y).sum()
        res[1] += (top5 == y[:, None]).any(dim=1).sum()
        res[2] += y.numel()
    dist.all_reduce(res)
    model.train()
    return (res[0] / res[2]).item(), (res[1] / res[2]).item()


def run(rank, world, port, args, log_files):
    sys.stdout = sys.stderr = log_files[rank]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, sampler = build_data(args.data, rank, world, args.batch_size, args.workers)

    teacher = torchvision.models.resnet50()
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = torchvision.models.mobilenet_v3_large(num_classes=1000)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    lr = args.lr * args.batch_size * world / 1024
    opt = torch.optim.RMSprop(student.parameters(), lr=lr, alpha=0.9, eps=0.0316, momentum=0.9, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.973)
    scaler = torch.cuda.amp.GradScaler()

    start, best = 0, 0.0
    last = os.path.join(args.out, "student_last.pth")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        student.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start, best = ck["epoch"] + 1, ck["best"]
        print(f"resumed at epoch {start}", flush=True)
    student_ddp = DDP(student, device_ids=[rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student_ddp(x)
            loss = kd_loss(s_logits.float(), t_logits.float(), y, args.T, args.alpha)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if i % 100 == 0:
                print(f"ep {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f}", flush=True)
        sched.step()

        top1, top5 = validate(student, val_loader, device)
        print(f"ep {epoch} val top1 {top1:.4f} top5 {top5:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if rank == 0:
            is_best = top1 > best
            best = max(best, top1)
            state = {"model": student.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            if is_best:
                torch.save(student.state_dict(), os.path.join(args.out, "student_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


def pick_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = parse_args()
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    for attempt in range(1, args.attempts + 1):
        log_files = [open(os.path.join(log_dir, f"rank{r}.log"), "a", buffering=1) for r in range(args.gpus)]
        for f in log_files:
            f.write(f"===== attempt {attempt} {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
        port = pick_port()
        try:
            mp.spawn(run, args=(args.gpus, port, args, log_files), nprocs=args.gpus, join=True)
            print("finished", flush=True)
            return 0
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"attempt {attempt} failed:\n{e}", flush=True)
        finally:
            for f in log_files:
                f.close()
        time.sleep(20)
    return 1


if __name__ == "__main__":
    sys.exit(main())
