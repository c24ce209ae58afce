"""Regularised (aging) evolution over sub-networks of a one-shot supernet.

Each candidate gets fresh BN statistics (recalibrated on training images)
before it is scored on the validation split. The evaluation is spread over
all GPUs with a DistributedSampler.

    torchrun --nproc_per_node=8 14_aging_evo_bn_recalib.py --data /datasets/imagenet100 \
        --supernet runs/supernet/final.pth --cycles 1000
"""
import argparse
import collections
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from oneshot.supernet import MobileSuperNet, SEARCH_SPACE


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--supernet", required=True)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--population", type=int, default=64)
    ap.add_argument("--sample-size", type=int, default=16)
    ap.add_argument("--calib-batches", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=2020)
    ap.add_argument("--out", default="runs/aging_evo")
    return ap.parse_args()


def random_arch(rng):
    return tuple(rng.randrange(len(SEARCH_SPACE[i])) for i in range(len(SEARCH_SPACE)))


def mutate(arch, rng):
    pos = rng.randrange(len(arch))
    choices = [c for c in range(len(SEARCH_SPACE[pos])) if c != arch[pos]]
    child = list(arch)
    child[pos] = rng.choice(choices)
    return tuple(child)


@torch.no_grad()
def recalibrate(model, arch, calib_loader, n_batches, device):
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    for i, (images, _) in enumerate(calib_loader):
        if i == n_batches:
            break
        model(images.to(device, non_blocking=True), arch)
    model.eval()


@torch.no_grad()
def score(model, arch, calib_loader, val_loader, args, device):
    recalibrate(model, arch, calib_loader, args.calib_batches, device)
    correct = total = 0
    for images, labels in val_loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        pred = model(images, arch).argmax(dim=1)
        correct += (pred == labels).sum().item()
        total += labels.size(0)
    return correct / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    calib_set = datasets.ImageFolder(os.path.join(args.data, "train"), val_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    # Calibration images: one fixed subset, identical on every rank.
    g = torch.Generator().manual_seed(args.seed)
    calib_idx = torch.randperm(len(calib_set), generator=g)[: args.calib_batches * args.batch_size].tolist()
    calib_loader = DataLoader(Subset(calib_set, calib_idx), batch_size=args.batch_size, shuffle=False,
                              num_workers=8, pin_memory=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=8,
                            pin_memory=True)

    model = MobileSuperNet(num_classes=len(val_set.classes))
    state = torch.load(args.supernet, map_location="cpu")
    model.load_state_dict(state["model"] if "model" in state else state)
    model.to(device).eval()

    rng = random.Random(args.seed)  # same stream on every rank
    population = collections.deque()
    history = []
    t0 = time.time()

    while len(population) < args.population:
        arch = random_arch(rng)
        acc = score(model, arch, calib_loader, val_loader, args, device)
        population.append((arch, acc))
        history.append({"arch": arch, "acc": acc})

    while len(history) < args.cycles:
        sample = [population[rng.randrange(len(population))] for _ in range(args.sample_size)]
        parent = max(sample, key=lambda t: t[1])
        child = mutate(parent[0], rng)
        acc = score(model, child, calib_loader, val_loader, args, device)
        population.append((child, acc))
        population.popleft()
        history.append({"arch": child, "acc": acc})
        if rank == 0 and len(history) % 20 == 0:
            best = max(history, key=lambda h: h["acc"])
            print(f"[{len(history)}/{args.cycles}] best {best['acc']:.4f} {best['arch']} "
                  f"({time.time() - t0:.0f}s)", flush=True)

    best = max(history, key=lambda h: h["acc"])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"best": best, "history": history}, f)
        print("best architecture:", best, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
