#!/usr/bin/env python3
"""ViT-B/16 fine-tuning under IBM Spectrum LSF.

    #BSUB -J vit-ft
    #BSUB -q gpu
    #BSUB -n 2
    #BSUB -R "span[ptile=1]"
    #BSUB -gpu "num=4:mode=shared"
    #BSUB -W 12:00
    #BSUB -o logs/vit.%J.out
    blaunch python vit_ft.py --data /gpfs/proj/inat21 --epochs 30

blaunch runs one copy of this file per host. Each copy reads the host list
from LSB_MCPU_HOSTS and starts one training process per GPU, pinning every
process to a single GPU of the ones LSF gave the job on that host.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=96, help="per process")
    p.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 512")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--out", default="/gpfs/proj/runs/vit-ft")
    return p.parse_args()


# ----------------------------------------------------------------------------
# launcher side
# ----------------------------------------------------------------------------
def lsf_hosts():
    toks = os.environ["LSB_MCPU_HOSTS"].split()
    hosts = [toks[i] for i in range(0, len(toks), 2)]
    return [h.split(".")[0] for h in hosts]


def launch():
    args = parse()
    hosts = lsf_hosts()
    me = socket.gethostname().split(".")[0]
    node_rank = hosts.index(me)
    gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    nproc = len(gpus)
    world = nproc * len(hosts)
    procs = []
    for local_rank in range(nproc):
        env = dict(os.environ)
        env.update({
            "CUDA_VISIBLE_DEVICES": gpus[local_rank],
            "MASTER_ADDR": hosts[0],
            "MASTER_PORT": str(args.port),
            "WORLD_SIZE": str(world),
            "RANK": str(node_rank * nproc + local_rank),
            "LOCAL_RANK": str(local_rank),
            "VIT_WORKER": "1",
        })
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env))
    rc = 0
    for p in procs:
        rc = p.wait() or rc
    sys.exit(rc)


# ----------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        t[0] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        t[1] += (logits.argmax(-1) == y).sum()
        t[2] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[2]).item(), (100 * t[1] / t[2]).item()


def worker(args):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    model = timm.create_model(args.model, pretrained=True, num_classes=10000, drop_path_rate=0.1)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1")
    val_tf = create_transform(**data_cfg)
    train_ds = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model.to(device)
    model = DDP(model, device_ids=[device])

    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05,
                                                anneal_strategy="cos")
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} procs, lr {lr:.2e}, {len(train_dl)} it/epoch", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}:{it}] loss={loss.item():.3f} lr={sched.get_last_lr()[0]:.2e}", flush=True)

        vloss, acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: val_loss={vloss:.3f} top1={acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("VIT_WORKER") == "1":
        worker(parse())
    else:
        launch()
