"""ConvNeXt-T training on Kubernetes, Indexed Job with a headless Service.

The Job (k8s/convnext-job.yaml) has completionMode: Indexed, parallelism = completions = NNODES,
subdomain "convnext", 8 GPUs per pod and the dataset PVC mounted at /data, outputs at /results
(ReadWriteMany). Container command:

    python /workspace/convnext_k8s.py launch --data /data/imagenet --out /results/convnext-t

`launch` turns the pod index into a node rank and execs torchrun;
torchrun then re-enters this file with `train`.
"""
import argparse
import math
import os
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def cmd_launch(args, passthrough):
    index = int(os.environ["JOB_COMPLETION_INDEX"])
    nnodes = int(os.environ["NNODES"])
    job = os.environ.get("JOB_NAME", "convnext")
    subdomain = os.environ.get("SUBDOMAIN", "convnext")
    master = f"{job}-0.{subdomain}"
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc_per_node", str(args.gpus_per_pod),
        "--node_rank", str(index),
        "--master_addr", master,
        "--master_port", str(args.port),
        __file__, "train", *passthrough,
    ]
    print(f"[pod {index}] {' '.join(argv)}", flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, argv)


def build_data(args, world, rank):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, antialias=True),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
        transforms.RandomErasing(p=0.25),
    ])
    val_tf = transforms.Compose([transforms.Resize(236, antialias=True), transforms.CenterCrop(224),
                                 transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, world, rank, shuffle=True, drop_last=True)
    val_ds = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=2 * args.batch_size, num_workers=args.workers, pin_memory=True)
    return train_dl, val_dl, train_sampler


def cmd_train(args):
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    train_dl, val_dl, train_sampler = build_data(args, world, rank)
    model = timm.create_model("convnext_tiny", num_classes=1000, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[args.local_rank])

    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 1024
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    iters = len(train_dl)
    warm = args.warmup_epochs * iters
    total = args.epochs * iters
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    crit = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} global_batch={global_batch} lr={lr:.2e} start_epoch={start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} [{it}/{iters}] loss {loss.item():.4f}", flush=True)

        model.eval()
        m = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                m[0] += (model.module(x).argmax(-1) == y).sum()
                m[1] += y.numel()
        dist.all_reduce(m)
        if rank == 0:
            print(f"epoch {epoch} top1 {100 * m[0].item() / m[1].item():.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("launch")
    pl.add_argument("--gpus-per-pod", type=int, default=8)
    pl.add_argument("--port", type=int, default=23456)
    pt = sub.add_parser("train")
    pt.add_argument("--data", required=True)
    pt.add_argument("--out", required=True)
    pt.add_argument("--epochs", type=int, default=300)
    pt.add_argument("--warmup-epochs", type=int, default=20)
    pt.add_argument("--batch-size", type=int, default=128)
    pt.add_argument("--lr", type=float, default=4e-3)
    pt.add_argument("--workers", type=int, default=10)
    pt.add_argument("--local_rank", type=int, default=0)

    args, rest = parser.parse_known_args()
    if args.cmd == "launch":
        cmd_launch(args, rest)
    else:
        cmd_train(parser.parse_args())


if __name__ == "__main__":
    main()
