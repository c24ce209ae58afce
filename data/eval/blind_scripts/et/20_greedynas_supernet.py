"""GreedyNAS supernet training: multi-path sampling with rejection.

Every step, m paths are drawn; their loss on a small held-out batch ranks
them and only the best k are trained on the current batch. Good paths are
kept in a candidate pool that later seeds the evolutionary search.

    torchrun --nproc_per_node=8 20_greedynas_supernet.py --data /datasets/imagenet --out runs/greedynas
"""
import argparse
import heapq
import os
import pickle
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

from greedynas.supernet import GreedySuperNet, NUM_LAYERS, NUM_OPS


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/greedynas")
    p.add_argument("--epochs", type=int, default=46)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.12, help="per 256 images")
    p.add_argument("--m", type=int, default=10, help="paths drawn per step")
    p.add_argument("--k", type=int, default=5, help="paths kept per step")
    p.add_argument("--pool-size", type=int, default=1000)
    p.add_argument("--pool-start-epoch", type=int, default=10)
    p.add_argument("--pool-prob", type=float, default=0.8, help="prob. of drawing from the pool")
    p.add_argument("--val-images", type=int, default=10000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CandidatePool:
    """Bounded pool of the best paths seen so far (lowest loss first)."""

    def __init__(self, size):
        self.size = size
        self.heap = []          # (-loss, path) so the worst path is at the top
        self.members = set()

    def __len__(self):
        return len(self.heap)

    def update(self, path, loss):
        if path in self.members:
            return
        if len(self.heap) < self.size:
            heapq.heappush(self.heap, (-loss, path))
            self.members.add(path)
        elif -self.heap[0][0] > loss:
            _, old = heapq.heapreplace(self.heap, (-loss, path))
            self.members.discard(old)
            self.members.add(path)

    def sample(self, rng):
        return rng.choice(self.heap)[1]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    full_train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    full_eval = datasets.ImageFolder(os.path.join(args.data, "train"), eval_tf)
    perm = torch.randperm(len(full_train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_set = Subset(full_train, perm[args.val_images:])
    # held-out images for ranking paths, each rank gets its own slice
    held_out = Subset(full_eval, perm[:args.val_images][rank::world])

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    held_loader = DataLoader(held_out, batch_size=args.batch_size, shuffle=True, num_workers=2,
                             pin_memory=True, drop_last=True)

    supernet = GreedySuperNet(num_classes=1000).to(device)
    model = DDP(supernet, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5, nesterov=True)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * iters)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    pool = CandidatePool(args.pool_size)

    def held_batches():
        while True:
            for xb, yb in held_loader:
                yield xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)

    held_iter = held_batches()
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            rng = random.Random(args.seed * 7_919 + epoch * iters + it)   # same draw on every rank
            paths = []
            for _ in range(args.m):
                if epoch >= args.pool_start_epoch and len(pool) > 0 and rng.random() < args.pool_prob:
                    paths.append(pool.sample(rng))
                else:
                    paths.append(tuple(rng.randrange(NUM_OPS) for _ in range(NUM_LAYERS)))

            # rank the paths on one held-out batch per rank; losses are averaged so all ranks agree
            xv, yv = next(held_iter)
            with torch.no_grad():
                supernet.eval()
                path_loss = torch.stack([F.cross_entropy(supernet(xv, p), yv) for p in paths])
                supernet.train()
            dist.all_reduce(path_loss, op=dist.ReduceOp.AVG)
            order = path_loss.argsort().tolist()
            kept = [paths[i] for i in order[:args.k]]
            for i in order[:args.k]:
                pool.update(paths[i], path_loss[i].item())

            optimizer.zero_grad(set_to_none=True)
            for path in kept:
                loss = criterion(model(x, path), y) / args.k
                loss.backward()
            optimizer.step()
            scheduler.step()

            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} [{it}/{iters}] loss {loss.item() * args.k:.4f} "
                      f"best-path loss {path_loss[order[0]].item():.3f} pool {len(pool)} "
                      f"{time.time() - tic:.0f}s", flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "model": supernet.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out, "supernet.pth"))
            with open(os.path.join(args.out, "candidate_pool.pkl"), "wb") as f:
                pickle.dump(sorted((-l, p) for l, p in pool.heap), f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
