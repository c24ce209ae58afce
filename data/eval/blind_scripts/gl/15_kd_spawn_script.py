# Knowledge distillation: ResNet-50 teacher -> ResNet-18 student on ImageNet-100.
#
#   python 15_kd_spawn_script.py --data /data/imagenet100 --teacher /models/r50_in100.pth \
#       --out /shared/kd/r18_from_r50 --world-size 8
#
# One process per GPU via torch.multiprocessing.spawn; per-rank logs go to <out>/logs.
import argparse
import logging
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse_args():
    p = argparse.ArgumentParser(description="KD on ImageNet-100")
    p.add_argument("--data", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.2, help="for a global batch of 512")
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--port", type=int, default=0)
    return p.parse_args()


def free_port():
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get_loaders(args, rank, world):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_sub = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_dl = DataLoader(val_sub, batch_size=128, num_workers=4, pin_memory=True)
    return train_dl, val_dl, train_sampler, len(train_ds.classes)


def kd_loss(student_logits, teacher_logits, target, T_, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T_, dim=1), F.softmax(teacher_logits / T_, dim=1),
                    reduction="batchmean") * T_ * T_
    hard = F.cross_entropy(student_logits, target)
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        top5 = out.topk(5, 1).indices
        c[0] += (top5[:, 0] == y).sum()
        c[1] += (top5 == y[:, None]).any(1).sum()
        c[2] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def train(rank, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=args.world_size)
    device = torch.device("cuda", rank)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    logging.basicConfig(filename=os.path.join(args.out, "logs", f"rank{rank}.log"), level=logging.INFO,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger()

    train_dl, val_dl, sampler, n_cls = get_loaders(args, rank, args.world_size)

    teacher = torchvision.models.resnet50(num_classes=n_cls)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = torchvision.models.resnet18(num_classes=n_cls)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[rank])

    lr = args.lr * args.batch_size * args.world_size / 512
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    t_top1, _ = accuracy(teacher, val_dl, device)
    log.info("teacher top1 %.4f", t_top1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
                loss = kd_loss(s_logits.float(), t_logits.float(), y, args.temperature, args.alpha)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if i % 100 == 0:
                log.info("epoch %d iter %d/%d loss %.4f lr %.4f", epoch, i, len(train_dl), loss.item(),
                         sched.get_last_lr()[0])
        top1, top5 = accuracy(student, val_dl, device)
        log.info("epoch %d top1 %.4f top5 %.4f (%.0fs)", epoch, top1, top5, time.time() - t0)
        if rank == 0 and top1 > best:
            best = top1
            torch.save(student.module.state_dict(), os.path.join(args.out, "student_best.pth"))
        if rank == 0:
            torch.save({"model": student.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "student_last.pth"))

    dist.destroy_process_group()


args = parse_args()
os.makedirs(args.out, exist_ok=True)
if not args.port:
    args.port = free_port()
print(f"spawning {args.world_size} workers, rendezvous on port {args.port}")
try:
    mp.spawn(train, args=(args,), nprocs=args.world_size, join=True)
except mp.ProcessRaisedException as e:
    print("training failed:\n", e)
    raise SystemExit(1)
print("done, best student weights in", os.path.join(args.out, "student_best.pth"))
