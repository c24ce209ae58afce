"""Prototypical Networks (Snell et al. 2017) on mini-ImageNet with a ResNet-12 backbone.

Raw images are decoded and resized once into a pickle cache next to the csv
split files; later runs read the cache directly.

    torchrun --nproc_per_node=4 12_protonet_episodic.py --root /data/miniimagenet --shot 5
"""
import argparse
import csv
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm


def load_split(root, split, size):
    cache = os.path.join(root, f"cache_{split}_{size}.pkl")
    if not os.path.exists(cache):
        images, labels, wnids = [], [], {}
        with open(os.path.join(root, f"{split}.csv")) as f:
            rows = list(csv.reader(f))[1:]
        for fname, wnid in tqdm(rows, desc=f"building {split} cache"):
            img = Image.open(os.path.join(root, "images", fname)).convert("RGB")
            images.append(np.asarray(img.resize((size, size), Image.BILINEAR), dtype=np.uint8))
            labels.append(wnids.setdefault(wnid, len(wnids)))
        with open(cache, "wb") as f:
            pickle.dump({"images": np.stack(images), "labels": np.asarray(labels)}, f, protocol=4)
    with open(cache, "rb") as f:
        data = pickle.load(f)
    return data["images"], data["labels"]


class MiniImageNet(Dataset):
    MEAN = np.array([0.472, 0.453, 0.410], dtype=np.float32)
    STD = np.array([0.277, 0.268, 0.285], dtype=np.float32)

    def __init__(self, images, labels, augment=False):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].astype(np.float32) / 255.0
        if self.augment and np.random.rand() < 0.5:
            x = x[:, ::-1]
        x = (x - self.MEAN) / self.STD
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))), int(self.labels[i])


class EpisodeSampler(Sampler):
    """Yields index lists of n_way * (n_shot + n_query) images, class-major order."""

    def __init__(self, labels, n_episodes, n_way, n_shot, n_query, seed):
        self.n_episodes, self.n_way, self.n_per = n_episodes, n_way, n_shot + n_query
        self.by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        rng = np.random.default_rng(self.seed + 100003 * self.epoch)
        for _ in range(self.n_episodes):
            classes = rng.choice(len(self.by_class), self.n_way, replace=False)
            batch = [rng.choice(self.by_class[c], self.n_per, replace=False) for c in classes]
            yield np.concatenate(batch).tolist()


def conv3x3(cin, cout):
    return nn.Conv2d(cin, cout, 3, 1, 1, bias=False)


class ResBlock12(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(
            conv3x3(cin, cout), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
            conv3x3(cout, cout), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
            conv3x3(cout, cout), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(F.leaky_relu(self.body(x) + self.skip(x), 0.1))


class ResNet12(nn.Module):
    def __init__(self, widths=(64, 160, 320, 640)):
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            layers.append(ResBlock12(cin, w))
            cin = w
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x).mean(dim=(2, 3))


def proto_logits(emb, n_way, n_shot, n_query, temperature):
    emb = emb.view(n_way, n_shot + n_query, -1)
    support, query = emb[:, :n_shot], emb[:, n_shot:]
    protos = support.mean(1)
    query = query.reshape(n_way * n_query, -1)
    return -torch.cdist(query, protos).pow(2) / temperature


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--size", type=int, default=84)
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--train-way", type=int, default=20)
    ap.add_argument("--shot", type=int, default=1)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--episodes", type=int, default=200, help="episodes per worker per epoch")
    ap.add_argument("--test-episodes", type=int, default=500, help="per worker")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", default="checkpoints/protonet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_x, train_y = load_split(args.root, "train", args.size)
    test_x, test_y = load_split(args.root, "test", args.size)
    train_set = MiniImageNet(train_x, train_y, augment=True)
    test_set = MiniImageNet(test_x, test_y)

    # episodes are drawn independently on each worker (different seeds)
    train_sampler = EpisodeSampler(train_y, args.episodes, args.train_way, args.shot, args.query,
                                   seed=args.seed * 1000 + rank)
    test_sampler = EpisodeSampler(test_y, args.test_episodes, args.way, args.shot, args.query,
                                  seed=12345 + rank)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, num_workers=6, pin_memory=True)
    test_loader = DataLoader(test_set, batch_sampler=test_sampler, num_workers=6, pin_memory=True)

    torch.manual_seed(args.seed)
    model = DDP(ResNet12().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        label = torch.arange(args.train_way, device=device).repeat_interleave(args.query)
        tot = torch.zeros(3, device=device)
        for x, _ in train_loader:
            x = x.to(device, non_blocking=True)
            logits = proto_logits(model(x), args.train_way, args.shot, args.query, args.temperature)
            loss = F.cross_entropy(logits, label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach(), (logits.argmax(1) == label).float().mean(),
                                torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        label = torch.arange(args.way, device=device).repeat_interleave(args.query)
        accs = []
        with torch.no_grad():
            for x, _ in test_loader:
                logits = proto_logits(model.module(x.to(device)), args.way, args.shot, args.query,
                                      args.temperature)
                accs.append((logits.argmax(1) == label).float().mean())
        accs = torch.stack(accs)
        summary = torch.stack([accs.sum(), (accs ** 2).sum(), torch.tensor(float(len(accs)), device=device)])
        dist.all_reduce(tot)
        dist.all_reduce(summary)

        if rank == 0:
            n = summary[2].item()
            mean = summary[0].item() / n
            std = np.sqrt(max(summary[1].item() / n - mean ** 2, 0.0))
            ci95 = 1.96 * std / np.sqrt(n)
            print(f"epoch {epoch}: train loss {(tot[0] / tot[2]).item():.3f} "
                  f"acc {(tot[1] / tot[2]).item():.3f} | test {args.way}-way {args.shot}-shot "
                  f"{100 * mean:.2f} +- {100 * ci95:.2f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": mean},
                       os.path.join(args.save, "last.pth"))
            if mean > best:
                best = mean
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": mean},
                           os.path.join(args.save, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
