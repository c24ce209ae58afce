"""Least-confidence active learning on SVHN with a WRN-16-4.

    torchrun --standalone --nproc_per_node=8 05_al_svhn_leastconf.py --root /datasets/svhn --save /shared/al/svhn_lc
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

logger = logging.getLogger("al_svhn")


# ----------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop > 0:
            y = F.dropout(y, p=self.drop, training=self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=16, widen=4, num_classes=10, drop=0.0):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(cin, widths[i + 1], stride if j == 0 else 1, drop))
                cin = widths[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


# ----------------------------------------------------------------------------- helpers
def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/svhn")
    ap.add_argument("--save", required=True)
    ap.add_argument("--init", type=int, default=1000)
    ap.add_argument("--query", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch", type=int, default=512, help="global batch")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


@torch.no_grad()
def max_prob(net, ds, idx, device):
    loader = DataLoader(Subset(ds, idx.tolist()), batch_size=1024, num_workers=4, pin_memory=True)
    net.eval()
    out = []
    for x, _ in loader:
        out.append(F.softmax(net(x.to(device, non_blocking=True)), dim=1).max(1).values)
    return torch.cat(out)


@torch.no_grad()
def test_accuracy(net, ds, device, rank, world):
    idx = np.arange(rank, len(ds), world)
    loader = DataLoader(Subset(ds, idx.tolist()), batch_size=1024, num_workers=4)
    net.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        t[0] += (net(x.to(device)).argmax(1) == y).sum()
        t[1] += len(y)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(message)s")
    writer = SummaryWriter(os.path.join(args.save, "tb")) if rank == 0 else None

    norm = transforms.Normalize((0.4377, 0.4438, 0.4728), (0.198, 0.201, 0.197))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=2), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_ds = datasets.SVHN(args.root, split="train", transform=train_tf)
    pool_ds = datasets.SVHN(args.root, split="train", transform=test_tf)
    test_ds = datasets.SVHN(args.root, split="test", transform=test_tf)

    g = np.random.default_rng(args.seed)
    labelled = np.sort(g.choice(len(train_ds), args.init, replace=False))
    unlabelled = np.setdiff1d(np.arange(len(train_ds)), labelled)

    per_gpu = args.batch // world
    for rnd in range(args.rounds):
        tic = time.time()
        torch.manual_seed(args.seed)
        net = DDP(WideResNet(16, 4, 10, drop=0.3).to(device), device_ids=[local_rank])
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
        train_sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(train_sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(train_sub, batch_size=per_gpu, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        milestones = [int(args.epochs * 0.5), int(args.epochs * 0.75)]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            net.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()

        acc = test_accuracy(net.module, test_ds, device, rank, world)

        # score this rank's strided share of the pool, then collect everything
        mine = unlabelled[rank::world]
        conf = max_prob(net.module, pool_ds, mine, device)
        gathered = [torch.empty_like(conf) for _ in range(world)]
        dist.all_gather(gathered, conf)
        conf_all = torch.cat(gathered).cpu().numpy()
        order_all = np.concatenate([unlabelled[r::world] for r in range(world)])

        k = min(args.query, len(unlabelled))
        picked = order_all[np.argsort(conf_all, kind="stable")[:k]]
        labelled = np.sort(np.concatenate([labelled, picked]))
        unlabelled = np.setdiff1d(unlabelled, picked)

        if rank == 0:
            logger.info("round %2d  labelled %6d  test acc %.4f  (%.1f min)",
                        rnd, len(train_sub), acc, (time.time() - tic) / 60)
            writer.add_scalar("al/test_acc", acc, len(train_sub))
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": net.module.state_dict(), "labelled": torch.from_numpy(labelled),
                        "round": rnd}, os.path.join(args.save, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
