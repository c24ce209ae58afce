#!/usr/bin/env python3
"""RFS baseline (Tian et al. 2020, "Rethinking Few-Shot Image Classification").

Train a ResNet-12 with plain cross-entropy on all 64 meta-train classes merged, then
evaluate few-shot by fitting a logistic-regression classifier on frozen, L2-normalised
embeddings of each test episode's support set. Multi-GPU with DDP.

    torchrun --nproc_per_node=4 19_rfs_pretrain_logreg.py --data /data/miniImageNet --tag rfs_r12
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.linear_model import LogisticRegression
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def parse_option():
    parser = argparse.ArgumentParser("RFS distributed")
    parser.add_argument("--data", default="/data/miniImageNet", help="folder with miniImageNet_category_split_*.pickle")
    parser.add_argument("--tag", default="rfs")
    parser.add_argument("--model-dir", default="./models_pretrained")
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-decay-epochs", type=int, nargs="+", default=[60, 80])
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--n-test-runs", type=int, default=600, help="test episodes over all GPUs")
    parser.add_argument("--n-ways", type=int, default=5)
    parser.add_argument("--n-shots", type=int, default=1)
    parser.add_argument("--n-queries", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


MEAN = [120.39586422 / 255.0, 115.59361427 / 255.0, 104.54012653 / 255.0]
STD = [70.68188272 / 255.0, 68.27635443 / 255.0, 72.54505529 / 255.0]


class ImageNetPickle(Dataset):
    def __init__(self, root, partition, train):
        with open(os.path.join(root, f"miniImageNet_category_split_{partition}.pickle"), "rb") as f:
            data = pickle.load(f, encoding="latin1")
        self.imgs = data["data"]
        labels = data["labels"]
        base = min(labels)
        self.labels = np.array([l - base for l in labels])
        if train:
            self.transform = transforms.Compose([
                lambda x: Image.fromarray(x),
                transforms.RandomCrop(84, padding=8),
                transforms.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ])
        else:
            self.transform = transforms.Compose([
                lambda x: Image.fromarray(x),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(self.imgs[i]), self.labels[i]


class DropBlockFreeBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.c3, self.b3 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.LeakyReLU(0.1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.relu(self.b2(self.c2(out)))
        out = self.b3(self.c3(out))
        return self.pool(self.relu(out + self.down(x)))


class ResNet12(nn.Module):
    def __init__(self, num_classes=64):
        super().__init__()
        self.layers = nn.Sequential(DropBlockFreeBlock(3, 64), DropBlockFreeBlock(64, 160),
                                    DropBlockFreeBlock(160, 320), DropBlockFreeBlock(320, 640))
        self.classifier = nn.Linear(640, num_classes)

    def embed(self, x):
        return F.adaptive_avg_pool2d(self.layers(x), 1).flatten(1)

    def forward(self, x):
        return self.classifier(self.embed(x))


def adjust_learning_rate(epoch, opt, args, world_size):
    steps = sum(epoch >= e for e in args.lr_decay_epochs)
    lr = args.lr * math.sqrt(world_size) * (0.1 ** steps)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def meta_test(net, dataset, args, rank, world, device):
    """Logistic regression on frozen features; each rank runs n_test_runs / world episodes."""
    net.eval()
    rng = np.random.RandomState(1000 + rank)
    by_class = [np.flatnonzero(dataset.labels == c) for c in range(dataset.labels.max() + 1)]
    accs = torch.zeros(3, device=device, dtype=torch.float64)
    for _ in range(args.n_test_runs // world):
        classes = rng.choice(len(by_class), args.n_ways, replace=False)
        s_idx, q_idx, s_y, q_y = [], [], [], []
        for j, c in enumerate(classes):
            pick = rng.choice(by_class[c], args.n_shots + args.n_queries, replace=False)
            s_idx += pick[: args.n_shots].tolist()
            q_idx += pick[args.n_shots:].tolist()
            s_y += [j] * args.n_shots
            q_y += [j] * args.n_queries
        x = torch.stack([dataset[i][0] for i in s_idx + q_idx]).to(device)
        feat = F.normalize(net.embed(x), dim=1).cpu().numpy()
        clf = LogisticRegression(penalty="l2", random_state=0, C=1.0, solver="lbfgs", max_iter=1000,
                                 multi_class="multinomial")
        clf.fit(feat[: len(s_idx)], s_y)
        acc = float(np.mean(clf.predict(feat[len(s_idx):]) == np.array(q_y)))
        accs += torch.tensor([acc, acc * acc, 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(accs)
    mean = accs[0] / accs[2]
    std = torch.sqrt(torch.clamp(accs[1] / accs[2] - mean * mean, min=0.0))
    return mean.item(), (1.96 * std / torch.sqrt(accs[2])).item()


def main():
    args = parse_option()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    save_dir = os.path.join(args.model_dir, args.tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    train_set = ImageNetPickle(args.data, "train", train=True)
    test_set = ImageNetPickle(args.data, "test", train=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              num_workers=args.workers, pin_memory=True)

    model = ResNet12(num_classes=int(train_set.labels.max()) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)

    for epoch in range(1, args.epochs + 1):
        lr = adjust_learning_rate(epoch, optimizer, args, world)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats += torch.stack([loss.detach() * x.size(0), (out.argmax(1) == y).sum().float(),
                                  torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.4f} loss {(stats[0] / stats[2]).item():.4f} "
                  f"acc {(stats[1] / stats[2]).item():.4f} time {time.time() - t0:.1f}s", flush=True)
            if epoch % 10 == 0 or epoch == args.epochs:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": vars(args)},
                           os.path.join(save_dir, f"ckpt_epoch_{epoch}.pth"))

    acc, ci = meta_test(model.module, test_set, args, rank, world, device)
    if rank == 0:
        print(f"test {args.n_ways}-way {args.n_shots}-shot: {100 * acc:.2f} +- {100 * ci:.2f}")
        torch.save({"model": model.module.state_dict(), "opt": vars(args)}, os.path.join(save_dir, f"{args.tag}_last.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
