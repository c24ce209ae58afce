"""ResNet-50 on iNaturalist-2021 (mini) with ZeRO-1 AdamW and PowerSGD.

* ZeroRedundancyOptimizer shards the AdamW state over the ranks
* PowerSGD (rank 4, error feedback) compresses the DDP all-reduce after a
  dense warm-up period
* checkpoints hold the consolidated optimizer state, so a run can be resumed

torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=gpu-a01:29500 \
    17_zero_powersgd_resnet.py --data /lustre/inat21_mini --out /lustre/runs/r50_zero_psgd
"""
import argparse
import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

log = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW lr for a global batch of 512")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--psgd-rank", type=int, default=4)
    p.add_argument("--psgd-start", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def loaders(args):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(os.path.join(args.data, "train_mini"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.TrivialAugmentWide(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    tsamp = DistributedSampler(train, shuffle=True, drop_last=True)
    vsamp = DistributedSampler(val, shuffle=False, drop_last=False)
    tl = DataLoader(train, batch_size=args.batch_size, sampler=tsamp, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    vl = DataLoader(val, batch_size=128, sampler=vsamp, num_workers=args.workers, pin_memory=True)
    return tl, vl, tsamp, len(train.classes), len(val)


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    correct = torch.zeros(1, device=device, dtype=torch.long)
    seen = torch.zeros(1, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        correct += (pred == y).sum()
        seen += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    model.train()
    # seen can exceed n_total by < world_size because of the sampler's padding
    return correct.item() / seen.item(), seen.item() - n_total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    train_loader, val_loader, train_sampler, n_classes, n_val = loaders(args)

    model = torchvision.models.resnet50(num_classes=n_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    psgd_state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=args.psgd_rank,
                                        start_powerSGD_iter=args.psgd_start, use_error_feedback=True,
                                        warm_start=True)
    model.register_comm_hook(psgd_state, powerSGD.powerSGD_hook)

    global_batch = args.batch_size * args.accum * world
    lr = args.lr * global_batch / 512
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=lr, weight_decay=args.wd)
    steps_per_epoch = len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.05, anneal_strategy="cos",
                                                cycle_momentum=False)

    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start_epoch, best = 0, 0.0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        log.info("resumed from epoch %d", ckpt["epoch"])
        del ckpt
    os.makedirs(args.out, exist_ok=True)
    log.info("world %d, global batch %d, lr %.2e", world, global_batch, lr)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            if i >= steps_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                (loss / args.accum).backward()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sched.step()

        dist.all_reduce(running)
        acc, padded = evaluate(model, val_loader, device, n_val)
        log.info("epoch %d train_loss %.4f val_acc %.4f (%d padded) %.0fs", epoch,
                 (running[0] / running[1]).item(), acc, padded, time.time() - t0)

        # every rank has to take part in the consolidation, only rank 0 gets the full state
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            best = max(best, acc)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
