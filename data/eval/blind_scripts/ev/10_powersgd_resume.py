"""ConvNeXt-T on ImageNet with PowerSGD-compressed all-reduce (batched variant).

Jobs on the shared queue get preempted every ~4h, so the script checkpoints
every --ckpt-every steps and resumes from <out>/latest.pt automatically.

    torchrun --nproc_per_node=8 powersgd_resume.py --data /datasets/imagenet --out /shared/runs/cnx_psgd_r4
"""
import argparse
import math
import os
import signal
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets

STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3, help="peak LR for global batch 4096")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--rank-approx", type=int, default=4)
    p.add_argument("--start-iter", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2000)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def cosine_lr(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return 1e-6 + 0.5 * (peak - 1e-6) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def save(path, model, optimizer, scaler, step, epoch):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "step": step, "epoch": epoch}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        s[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        s[1] += (logits.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"),
                                     create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1"))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), create_transform(224, is_training=False))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=200, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    psgd_state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank_approx,
                                        start_powerSGD_iter=args.start_iter, min_compression_rate=2,
                                        use_error_feedback=True, warm_start=True)
    model.register_comm_hook(psgd_state, powerSGD.batched_powerSGD_hook)

    peak_lr = args.lr * args.batch_size * world / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    latest = os.path.join(args.out, "latest.pt")
    step, start_epoch = 0, 0
    if os.path.isfile(latest):
        ckpt = torch.load(latest)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        step, start_epoch = ckpt["step"], ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {latest} at step {step} (epoch {start_epoch})", flush=True)
    elif rank == 0:
        os.makedirs(args.out, exist_ok=True)

    skip = step - start_epoch * steps_per_epoch  # batches of the interrupted epoch already done
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            if epoch == start_epoch and i < skip:
                continue
            lr = cosine_lr(step, total_steps, warmup_steps, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} ep {epoch} loss {loss.item():.4f} lr {lr:.2e} "
                      f"{(time.time() - t0) / (i + 1 - (skip if epoch == start_epoch else 0)):.3f}s/it", flush=True)

            stop = torch.tensor(float(STOP), device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if step % args.ckpt_every == 0 or stop.item() > 0:
                if rank == 0:
                    save(latest, model, optimizer, scaler, step, epoch)
                dist.barrier()
                if stop.item() > 0:
                    dist.destroy_process_group()
                    return

        val_loss, top1 = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} top1 {top1:.2f}", flush=True)
            save(latest, model, optimizer, scaler, step, epoch + 1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
