"""EfficientNet-B3 on Places365, PBS Pro with Cray PALS mpiexec (one rank per GPU).

Job script:

    #!/bin/bash
    #PBS -l select=4:system=polaris
    #PBS -l place=scatter
    #PBS -l walltime=06:00:00
    #PBS -l filesystems=home:eagle
    #PBS -q prod
    cd ${PBS_O_WORKDIR}
    NNODES=$(wc -l < $PBS_NODEFILE)
    mpiexec -n $((NNODES * 4)) --ppn 4 --depth 8 --cpu-bind depth \
        python effnet_places.py --data /eagle/proj/places365 --ckpt-dir /eagle/proj/runs/effnet_b3

The PBS_NODEFILE on this system has one line per node.
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def pals_env(port):
    rank = int(os.environ["PMI_RANK"])
    world = int(os.environ["PMI_SIZE"])
    local_rank = int(os.environ["PALS_LOCAL_RANKID"])
    with open(os.environ["PBS_NODEFILE"]) as f:
        master = f.readline().strip()
    os.environ["MASTER_ADDR"] = master
    os.environ["MASTER_PORT"] = str(port)
    return rank, world, local_rank


def make_loaders(root, rank, world, batch, workers):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    tr = transforms.Compose([transforms.RandomResizedCrop(300), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    te = transforms.Compose([transforms.Resize(320), transforms.CenterCrop(300),
                             transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = datasets.Places365(root, split="train-standard", small=True, transform=tr, download=False)
    val_ds = datasets.Places365(root, split="val", small=True, transform=te, download=False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=batch, sampler=sampler, num_workers=workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=2 * batch,
                        num_workers=workers, pin_memory=True)
    return train_dl, val_dl, sampler


def save_checkpoint(path, model, opt, sched, scaler, epoch, best):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best_top1": best,
    }, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    m = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        m[0] += (top5[:, 0] == y).sum()
        m[1] += (top5 == y[:, None]).any(1).sum()
        m[2] += y.numel()
    dist.all_reduce(m)
    return (100 * m[0] / m[2]).item(), (100 * m[1] / m[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.016, help="RMSprop lr for a global batch of 256")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--port", type=int, default=29555)
    args = ap.parse_args()

    rank, world, local_rank = pals_env(args.port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank)

    train_dl, val_dl, sampler = make_loaders(args.data, rank, world, args.batch, args.workers)
    model = timm.create_model("efficientnet_b3", num_classes=365, drop_rate=0.3, drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch * world / 256
    opt = torch.optim.RMSprop(model.parameters(), lr=lr, alpha=0.9, eps=1e-3, momentum=0.9, weight_decay=1e-5)
    steps = len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=3 * steps),
              torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97 ** (1 / (2.4 * steps)))],
        milestones=[3 * steps])
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best_top1"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i}/{steps} loss {loss.item():.3f}", flush=True)

        top1, top5 = validate(model.module, val_dl, device)
        best = max(best, top1)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} top5 {top5:.2f} best {best:.2f} "
                  f"epoch_time {time.time() - t0:.0f}s", flush=True)
        if local_rank == 0:
            save_checkpoint(last_path, model, opt, sched, scaler, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
