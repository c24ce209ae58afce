#!/usr/bin/env python3
"""ViT fine-tuning job wrapper.

Pins every worker to exactly one GPU through CUDA_VISIBLE_DEVICES, so inside a
worker the only GPU it can see is device 0.

Single node:
    python 02_vit_gpu_pinning_launcher.py --gpus 0,1,2,3 --data /data/inat21 --out /shared/runs/vit-b16
Two nodes (run on each, node-rank 0 and 1):
    python 02_vit_gpu_pinning_launcher.py --gpus 0,1,2,3,4,5,6,7 --nnodes 2 --node-rank 0 \
        --master-addr 10.1.0.11 --master-port 29411 --data /data/inat21 --out /shared/runs/vit-b16
"""
import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger("vit")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["launcher", "worker"], default="launcher")
    p.add_argument("--gpus", default=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-per-gpu", type=int, default=64)
    p.add_argument("--base-lr", type=float, default=5e-4, help="lr for a global batch of 512")
    p.add_argument("--val-frac", type=float, default=0.05)
    return p.parse_args()


def free_port():
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def launch(args):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher: %(message)s")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    nproc = len(gpus)
    world = nproc * args.nnodes
    port = args.master_port or free_port()
    if args.nnodes > 1 and not args.master_port:
        raise SystemExit("--master-port must be given explicitly for multi-node runs")
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)

    children = []

    def terminate(*_):
        for p in children:
            if p.poll() is None:
                p.terminate()
        for p in children:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    def on_signal(signum, _):
        log.info("signal %d -> stopping workers", signum)
        terminate()
        sys.exit(1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    argv = [a for a in sys.argv[1:]]
    for attempt in range(args.max_restarts + 1):
        children.clear()
        for i, gpu in enumerate(gpus):
            rank = args.node_rank * nproc + i
            env = dict(os.environ,
                       CUDA_VISIBLE_DEVICES=gpu,
                       RANK=str(rank), LOCAL_RANK=str(i), WORLD_SIZE=str(world),
                       MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
            logf = open(os.path.join(args.out, "logs", f"node{args.node_rank}_rank{rank}.log"), "a")
            children.append(subprocess.Popen([sys.executable, __file__, *argv, "--role", "worker"],
                                             env=env, stdout=logf, stderr=subprocess.STDOUT))
            logf.close()
        log.info("attempt %d: %d workers on gpus %s, port %d", attempt, nproc, gpus, port)
        while True:
            rcs = [p.poll() for p in children]
            if any(rc not in (None, 0) for rc in rcs) or all(rc == 0 for rc in rcs):
                break
            time.sleep(3)
        if all(rc == 0 for rc in rcs):
            log.info("done")
            return 0
        log.warning("exit codes %s; restarting", rcs)
        terminate()
    return 1


def build_data(args):
    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), norm])
    full_train = datasets.ImageFolder(args.data, transform=train_tf)
    full_val = datasets.ImageFolder(args.data, transform=val_tf)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(full_train), generator=g).tolist()
    n_val = int(len(perm) * args.val_frac)
    return Subset(full_train, perm[n_val:]), Subset(full_val, perm[:n_val]), len(full_train.classes)


@torch.no_grad()
def evaluate(model, ds, args, rank, world):
    shard = Subset(ds, list(range(rank, len(ds), world)))
    dl = DataLoader(shard, batch_size=args.batch_per_gpu * 2, num_workers=6, pin_memory=True)
    model.eval()
    stats = torch.zeros(3).cuda()
    for x, y in dl:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        stats[0] += F.cross_entropy(out.float(), y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def work(args):
    # this process sees a single GPU
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank}: %(message)s")

    train_ds, val_ds, n_cls = build_data(args)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=n_cls).cuda()
    model = DDP(model, device_ids=[0])
    lr = args.base_lr * args.batch_per_gpu * world / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)

    ck_path = os.path.join(args.out, "checkpoint.pt")
    start_epoch, best = 0, 0.0
    if os.path.isfile(ck_path):
        ck = torch.load(ck_path, map_location="cuda:0")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        log.info("resuming at epoch %d", start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y) in enumerate(dl):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 50 == 0 and rank == 0:
                log.info("ep %d it %d/%d loss %.3f lr %.2e", epoch, it, len(dl), loss.item(),
                         sched.get_last_lr()[0])
        vloss, vacc = evaluate(model, val_ds, args, rank, world)
        if rank == 0:
            log.info("epoch %d val_loss %.4f acc %.4f (%.0fs)", epoch, vloss, vacc, time.time() - t0)
            best = max(best, vacc)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, ck_path + ".part")
            os.replace(ck_path + ".part", ck_path)
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": vloss, "val_acc": vacc}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if a.role == "worker":
        work(a)
    else:
        sys.exit(launch(a))
