#!/usr/bin/env python
"""ResNet-50 / ImageNet on our Torque cluster.

Job script (jobs/resnet50.pbs):

    #PBS -N rn50
    #PBS -l nodes=2:ppn=4:gpus=4
    #PBS -l walltime=24:00:00
    #PBS -j oe
    cd $PBS_O_WORKDIR
    module load anaconda3 cuda/12.1
    source activate torch
    pbsdsh -u bash -lc "cd $PBS_O_WORKDIR && source activate torch && python train_rn50.py --data /gpfs/datasets/imagenet"

pbsdsh -u starts this script once per node; each copy then spawns one worker
per GPU with torch.multiprocessing.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--ckpt-dir", default=os.path.join(os.environ.get("PBS_O_WORKDIR", "."), "checkpoints"))
    return p.parse_args()


def pbs_layout(gpus_per_node):
    with open(os.environ["PBS_NODEFILE"]) as f:
        hosts = [h.strip().split(".")[0] for h in f if h.strip()]
    me = socket.gethostname().split(".")[0]
    nnodes = len(hosts)
    node_rank = hosts.index(me)
    world_size = nnodes * gpus_per_node
    return hosts[0], node_rank, world_size


def build_loaders(args, rank, world_size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    # every rank scores a disjoint strided slice, so nothing is counted twice
    val_ds = Subset(val_ds, range(rank, len(val_ds), world_size))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    for images, target in loader:
        images = images.cuda(device, non_blocking=True)
        target = target.cuda(device, non_blocking=True)
        out = model(images)
        stats[0] += crit(out, target)
        stats[1] += (out.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100.0


def worker(local_rank, args, master_addr, node_rank, world_size):
    rank = node_rank * args.gpus_per_node + local_rank
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{master_addr}:{args.port}",
                            rank=rank, world_size=world_size)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world_size)

    model = torchvision.models.__dict__[args.arch]()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world_size / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, momentum=args.momentum, nesterov=True)
    warmup = 5 * len(train_loader)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup)],
        milestones=[warmup])
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).to(device)

    start_epoch, best_acc = 0, 0.0
    last = os.path.join(args.ckpt_dir, "last.pth")
    if os.path.isfile(last):
        ckpt = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world_size={world_size} lr={lr:.3f} steps/epoch={len(train_loader)}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.cuda(device, non_blocking=True)
            target = target.cuda(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.4f}", flush=True)

        val_loss, acc1 = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} acc@1 {acc1:.2f} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            best_acc = max(best_acc, acc1)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_acc": best_acc}
            torch.save(state, last)
            if acc1 >= best_acc:
                torch.save(state["model"], os.path.join(args.ckpt_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    master_addr, node_rank, world_size = pbs_layout(args.gpus_per_node)
    print(f"{socket.gethostname()}: node_rank={node_rank} world_size={world_size} "
          f"master={master_addr}:{args.port}", flush=True)
    mp.spawn(worker, args=(args, master_addr, node_rank, world_size),
             nprocs=args.gpus_per_node, join=True)


if __name__ == "__main__":
    main()
