"""Prototypical networks, single-node multi-GPU via torch.multiprocessing.spawn.

    python 11_protonet_spawn.py --gpus 4 --data /data/miniImageNet
    python 11_protonet_spawn.py --gpus 4 --data /data/miniImageNet --eval-only --ckpt runs/proto/best.pth

Class splits come from the split files (train.txt / val.txt / test.txt list the
wnids), so they are identical on every process; only the episode RNG is per rank.
"""
import argparse
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class FolderSplit(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, "splits", f"{split}.txt")) as f:
            wnids = sorted(line.strip() for line in f if line.strip())
        self.files, self.labels = [], []
        for y, wnid in enumerate(wnids):
            d = os.path.join(root, "images", wnid)
            for name in sorted(os.listdir(d)):
                self.files.append(os.path.join(d, name))
                self.labels.append(y)
        self.labels = np.asarray(self.labels)
        norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        aug = [transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip()] if train else \
              [transforms.Resize(96), transforms.CenterCrop(84)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), self.labels[i]


class Episodes:
    def __init__(self, labels, n, way, per, seed):
        self.pools = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.n, self.way, self.per = n, way, per
        self.rng = random.Random(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            classes = self.rng.sample(range(len(self.pools)), self.way)
            picks = [self.rng.sample(list(self.pools[c]), self.per) for c in classes]
            yield [picks[c][i] for i in range(self.per) for c in range(self.way)]


def conv4(hidden=64):
    def blk(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))
    return nn.Sequential(blk(3, hidden), blk(hidden, hidden), blk(hidden, hidden), blk(hidden, hidden),
                         nn.Flatten())


def episode(model, x, way, shot, query):
    z = model(x)
    protos = z[:way * shot].view(shot, way, -1).mean(0)
    logits = -torch.cdist(z[way * shot:], protos).pow(2)
    y = torch.arange(way, device=x.device).repeat(query)
    return F.cross_entropy(logits, y), (logits.argmax(1) == y).float().mean()


@torch.no_grad()
def evaluate(model, dataset, args, rank, world_size, device, n_episodes, seed):
    loader = DataLoader(dataset, num_workers=args.workers, pin_memory=True,
                        batch_sampler=Episodes(dataset.labels, n_episodes // world_size, args.way,
                                               args.shot + args.query, seed=seed + rank))
    model.eval()
    accs = [episode(model, x.to(device), args.way, args.shot, args.query)[1].item() for x, _ in loader]
    model.train()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, accs)
    accs = np.concatenate(everyone)
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def worker(rank, world_size, args):
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    val_set = FolderSplit(args.data, "val", train=False)
    test_set = FolderSplit(args.data, "test", train=False)
    model = DDP(conv4().to(device), device_ids=[rank])

    if args.eval_only:
        state = torch.load(args.ckpt, map_location=device)
        # accept checkpoints saved either from the wrapper or from the bare module
        consume_prefix_in_state_dict_if_present(state, "module.")
        model.module.load_state_dict(state)
        acc, ci = evaluate(model, test_set, args, rank, world_size, device, args.test_episodes, 99)
        if rank == 0:
            print(f"test: {100 * acc:.2f} +- {100 * ci:.2f}")
        dist.destroy_process_group()
        return

    train_set = FolderSplit(args.data, "train", train=True)
    train_loader = DataLoader(train_set, num_workers=args.workers, pin_memory=True,
                              batch_sampler=Episodes(train_set.labels, args.episodes, args.train_way,
                                                     args.shot + args.query,
                                                     seed=args.seed * 1000 + rank))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    best = 0.0
    for epoch in range(1, args.epochs + 1):
        loss_sum = torch.zeros(2, device=device)
        for x, _ in train_loader:
            loss, _ = episode(model, x.to(device, non_blocking=True), args.train_way, args.shot, args.query)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_sum)
        acc, ci = evaluate(model, val_set, args, rank, world_size, device, args.val_episodes, 7)
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.3f}, val {100 * acc:.2f} +- {100 * ci:.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pth"), map_location=device)
    model.module.load_state_dict(state)
    acc, ci = evaluate(model, test_set, args, rank, world_size, device, args.test_episodes, 99)
    if rank == 0:
        print(f"test {args.way}-way {args.shot}-shot: {100 * acc:.2f} +- {100 * ci:.2f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs/proto")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--way", type=int, default=5)
    parser.add_argument("--train-way", type=int, default=30)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--val-episodes", type=int, default=600)
    parser.add_argument("--test-episodes", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
