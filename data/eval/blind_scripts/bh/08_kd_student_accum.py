"""Logit distillation from a frozen ResNet-101 teacher into a ResNet-18 student on ImageNet.

Large effective batch with gradient accumulation (no_sync on the intermediate micro-steps),
bf16 autocast, warm-up + cosine over optimizer steps, wandb on the main process.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        08_kd_student_accum.py --data /mnt/shared/imagenet --out /mnt/shared/runs/kd_r18
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

try:
    import wandb
except ImportError:
    wandb = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--micro-batch", type=int, default=64, help="images per GPU per forward")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.1, help="lr at an effective batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--kd-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--wandb-project", default=None)
    return p.parse_args()


def build_data(args, rank, world):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.micro_batch, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_part = Subset(val, range(rank, len(val), world))
    val_loader = DataLoader(val_part, batch_size=200, num_workers=args.workers, pin_memory=True)
    return sampler, train_loader, val_loader


def distill_loss(s_logits, t_logits, target, tau, kd_weight):
    kl = F.kl_div(F.log_softmax(s_logits / tau, -1), F.log_softmax(t_logits / tau, -1),
                  reduction="batchmean", log_target=True) * tau ** 2
    return F.cross_entropy(s_logits, target) + kd_weight * kl


def lr_factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    agg = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(images).float()
        top5 = out.topk(5, dim=1).indices
        agg[0] += (top5[:, 0] == target).sum()
        agg[1] += (top5 == target[:, None]).any(dim=1).sum()
        agg[2] += target.numel()
    dist.all_reduce(agg)
    return (100 * agg[0] / agg[2]).item(), (100 * agg[1] / agg[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0

    sampler, train_loader, val_loader = build_data(args, rank, world)

    # frozen teacher: identical torchvision weights on every rank, never updated, so no DDP wrapper.
    # local rank 0 fills the node's torch.hub cache first, the other ranks then read it.
    weights = torchvision.models.ResNet101_Weights.IMAGENET1K_V2
    if local_rank == 0:
        weights.get_state_dict(progress=False)
    dist.barrier()
    teacher = torchvision.models.resnet101(weights=weights)
    teacher = teacher.to(device).eval().requires_grad_(False)

    student = torchvision.models.resnet18().to(device)
    student = DDP(student, device_ids=[local_rank])

    eff_batch = args.micro_batch * args.accum * world
    peak_lr = args.lr * eff_batch / 256
    decay, no_decay = [], []
    for n, p in student.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=peak_lr, momentum=0.9, nesterov=True)
    micro_per_epoch = (len(train_loader) // args.accum) * args.accum
    steps_per_epoch = micro_per_epoch // args.accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, total_steps))

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ckpt["student"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    run = None
    if main_proc and wandb is not None and args.wandb_project:
        run = wandb.init(project=args.wandb_project, config={**vars(args), "world": world,
                                                             "eff_batch": eff_batch, "peak_lr": peak_lr})

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        it = iter(train_loader)
        for micro in range(micro_per_epoch):
            images, target = next(it)
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            last_micro = (micro + 1) % args.accum == 0
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_logits = teacher(images).float()
            sync_ctx = contextlib.nullcontext() if last_micro else student.no_sync()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s_logits = student(images).float()
                loss = distill_loss(s_logits, t_logits, target, args.tau, args.kd_weight) / args.accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(student.parameters(), 5.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step = scheduler.last_epoch
                if step % 50 == 0:
                    loss_rep = loss.detach() * args.accum
                    dist.all_reduce(loss_rep, op=dist.ReduceOp.AVG)
                    if main_proc:
                        print(f"ep {epoch} step {step}/{total_steps} loss {loss_rep.item():.4f} "
                              f"lr {scheduler.get_last_lr()[0]:.4f}", flush=True)
                        if run is not None:
                            run.log({"train/loss": loss_rep.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
        del it

        top1, top5 = validate(student.module, val_loader, device)
        if main_proc:
            print(f"epoch {epoch} val top1 {top1:.2f} top5 {top5:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if run is not None:
                run.log({"val/top1": top1, "val/top5": top5, "epoch": epoch}, step=scheduler.last_epoch)
            tmp = ckpt_path + ".tmp"
            torch.save({"student": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
