"""ConvNeXt-B on Places365 (DDP).  Tuned to fail fast: a short process-group
timeout plus torch elastic restarts means a wedged rank costs minutes, not the
default 30-minute NCCL watchdog.

    torchrun --nnodes=4 --nproc_per_node=8 --max-restarts=5 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29400 19_convnext_places_fastfail.py
"""
import argparse
import datetime
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/mnt/datasets/places365_standard")
    p.add_argument("--out", default="/mnt/shared/runs/convnext_b_places")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pg-timeout-min", type=int, default=5)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def transforms_for(train):
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    if train:
        return transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.RandAugment(2, 9), transforms.ToTensor(), norm,
                                   transforms.RandomErasing(0.25)])
    # 10-crop TTA for the held-out report
    return transforms.Compose([transforms.Resize(256), transforms.TenCrop(224),
                               transforms.Lambda(lambda crops: torch.stack(
                                   [norm(transforms.functional.to_tensor(c)) for c in crops]))])


@torch.no_grad()
def full_eval(net, loader, device):
    """Top-1 / top-5 with 10-crop averaging over the complete val set."""
    net.eval()
    top1 = top5 = n = 0
    for crops, y in loader:
        b = crops.size(0)
        crops, y = crops.to(device, non_blocking=True).flatten(0, 1), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(crops).float().view(b, 10, -1).mean(1)
        t5 = logits.topk(5, 1).indices
        top1 += (t5[:, 0] == y).sum().item()
        top5 += (t5 == y[:, None]).any(1).sum().item()
        n += b
    net.train()
    return top1 / n, top5 / n


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=args.pg_timeout_min))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = datasets.ImageFolder(os.path.join(args.root, "train"), transforms_for(True))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        val_ds = datasets.ImageFolder(os.path.join(args.root, "val"), transforms_for(False))
        val_dl = DataLoader(val_ds, batch_size=32, num_workers=args.workers, pin_memory=True)

    model = timm.create_model("convnext_base.fb_in22k", pretrained=True, num_classes=365,
                              drop_path_rate=0.3).to(device)
    model = DDP(model, device_ids=[local_rank])
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=365)
    criterion = SoftTargetCrossEntropy()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * args.bs * world / 4096, weight_decay=args.wd)
    steps = len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=args.warmup * steps),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, (args.epochs - args.warmup) * steps, eta_min=1e-6)],
        milestones=[args.warmup * steps])

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
        dist.all_reduce(loss_acc)

        if rank == 0:
            top1, top5 = full_eval(model.module, val_dl, device)
            print(f"epoch {epoch}: train_loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"val top1 {top1:.4f} top5 {top5:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
