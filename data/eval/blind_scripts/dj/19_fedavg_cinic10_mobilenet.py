"""FedAvg on CINIC-10 with MobileNetV3-small clients.

CINIC-10 (ImageFolder layout: train/ valid/ test/). One client per rank,
label-skewed Dirichlet split of train/. Every `eval_every` rounds the global
model is evaluated on test/, with the test images spread over all ranks.

    torchrun --nproc_per_node=8 19_fedavg_cinic10_mobilenet.py --root /data/CINIC-10
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

CINIC_MEAN = [0.47889522, 0.47227842, 0.43047404]
CINIC_STD = [0.24205776, 0.23828046, 0.25874835]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/CINIC-10")
    p.add_argument("--out", default="./runs/cinic_fedavg")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--local_epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def dirichlet_split(targets, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    parts = [[] for _ in range(n_clients)]
    for c in np.unique(targets):
        ids = rng.permutation(np.flatnonzero(targets == c))
        q = rng.dirichlet(np.full(n_clients, alpha))
        for k, chunk in enumerate(np.split(ids, (np.cumsum(q)[:-1] * len(ids)).astype(int))):
            parts[k].extend(chunk.tolist())
    return parts


def local_train(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5)
    tot, cnt = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item() * y.size(0)
            cnt += y.size(0)
    return tot, cnt


@torch.no_grad()
def average_state(model, n_local, device):
    n = torch.tensor([float(n_local)], device=device)
    total = n.clone()
    dist.all_reduce(total)
    ratio = (n / total).item()
    for t in model.state_dict().values():
        if t.is_floating_point():  # skips BN num_batches_tracked
            t.mul_(ratio)
            dist.all_reduce(t)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, count, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += y.size(0)
    return correct / count, loss_sum / count


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize(CINIC_MEAN, CINIC_STD)
    train_ds = datasets.ImageFolder(os.path.join(args.root, "train"), transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    test_ds = datasets.ImageFolder(os.path.join(args.root, "test"),
                                   transforms.Compose([transforms.ToTensor(), norm]))

    parts = dirichlet_split(train_ds.targets, world, args.alpha, args.seed)
    n_local = len(parts[rank])
    train_loader = DataLoader(Subset(train_ds, parts[rank]), batch_size=args.batch_size,
                              shuffle=True, num_workers=args.workers, pin_memory=True,
                              drop_last=True)
    test_sampler = DistributedSampler(test_ds, num_replicas=world, rank=rank, shuffle=False)
    test_loader = DataLoader(test_ds, batch_size=500, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = models.mobilenet_v3_small(num_classes=10).to(device)
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc, log = 0.0, []
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        loss_sum, seen = local_train(model, train_loader, args.local_epochs, args.lr, device)
        average_state(model, n_local, device)
        tr = torch.tensor([loss_sum, float(seen)], device=device)
        dist.all_reduce(tr)
        train_loss = (tr[0] / tr[1]).item()

        if rnd % args.eval_every == 0 or rnd == args.rounds:
            test_acc, test_loss = evaluate(model, test_loader, device)
            if rank == 0:
                rec = {"round": rnd, "train_loss": train_loss, "test_loss": test_loss,
                       "test_acc": test_acc, "sec": round(time.time() - t0, 1)}
                log.append(rec)
                print(json.dumps(rec), flush=True)
                if test_acc > best_acc:
                    best_acc = test_acc
                    torch.save({"round": rnd, "model": model.state_dict(), "acc": test_acc},
                               os.path.join(args.out, "best_global.pt"))
        elif rank == 0:
            print(f"round {rnd} train_loss {train_loss:.4f} ({time.time() - t0:.1f}s)", flush=True)

    if rank == 0:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"best_acc": best_acc, "log": log}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
