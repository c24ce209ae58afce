"""STL-10 supervised baseline for our SSL project (lab shared box, 2-4 GPUs).

Pieces taken from the PyTorch DDP tutorial (mp.spawn + free port) and the
"gradient accumulation with DDP" blog post (no_sync on the micro-steps).

    python 16_stl10_spawn_grad_accum.py --gpus 4 --accum 2 --epochs 100
"""
import argparse
import os
import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"]


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def make_datasets(root, rank):
    norm = T.Normalize((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713))
    train_tf = T.Compose([T.RandomResizedCrop(96, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.ToTensor(), norm])
    test_tf = T.Compose([T.ToTensor(), norm])
    if rank == 0:
        torchvision.datasets.STL10(root, split="train", download=True)
        torchvision.datasets.STL10(root, split="test", download=True)
    dist.barrier()   # the other ranks only read after rank 0 has finished extracting
    train = torchvision.datasets.STL10(root, split="train", transform=train_tf, download=False)
    test = torchvision.datasets.STL10(root, split="test", transform=test_tf, download=False)
    return train, test


def build_model():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def per_class_errors(model, loader, device):
    """Returns this rank's list of (true, pred) pairs for misclassified images."""
    model.eval()
    errs, correct, total = [], 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = model(x).argmax(1)
        correct += (p == y).sum().item()
        total += y.numel()
        bad = (p != y).nonzero().flatten()
        errs.extend(zip(y[bad].tolist(), p[bad].tolist()))
    return errs, correct, total


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds, test_ds = make_datasets(args.root, rank)
    micro_bs = args.global_bs // (world_size * args.accum)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=micro_bs, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    # unpadded strided shard: every test image is scored exactly once across the ranks
    test_shard = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world_size))
    test_dl = DataLoader(test_shard, batch_size=256, shuffle=False, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    updates_per_epoch = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=updates_per_epoch)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        n_micro = updates_per_epoch * args.accum
        for i, (x, y) in enumerate(train_dl):
            if i >= n_micro:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            # skip the gradient all-reduce on all but the last micro-batch of each update
            with (nullcontext() if last_micro else model.no_sync()):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / args.accum
                loss.backward()
            if last_micro:
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        if (epoch + 1) % args.eval_every == 0 or epoch == args.epochs - 1:
            errs, correct, total = per_class_errors(model.module, test_dl, device)
            gathered = [None] * world_size
            dist.all_gather_object(gathered, (errs, correct, total))
            if rank == 0:
                all_errs = [e for g in gathered for e in g[0]]
                acc = sum(g[1] for g in gathered) / sum(g[2] for g in gathered)
                worst = {}
                for t, _ in all_errs:
                    worst[CLASSES[t]] = worst.get(CLASSES[t], 0) + 1
                top = sorted(worst.items(), key=lambda kv: -kv[1])[:3]
                print(f"epoch {epoch + 1}: test acc {acc:.4f}, most confused {top}",
                      flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1},
                           os.path.join(args.out, "stl10_r18.pt"))
            dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--out", default="./checkpoints")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--global_bs", type=int, default=256)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    port = find_free_port()
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
