"""Traffic-sign recognition (GTSRB-style, 43 classes) with a WideResNet-28-4.

Images are pre-resized to 48x48 and packed into train.npz / test.npz
(see tools/pack_gtsrb.py).

    torchrun --nproc_per_node=4 12_traffic_sign_wrn.py --data data/gtsrb_48 --epochs 60
"""
import argparse
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2 as T

logger = logging.getLogger("tsr")


def get_parser():
    parser = argparse.ArgumentParser("traffic sign recognition")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--depth", type=int, default=28)
    parser.add_argument("--widen", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--save_dir", type=str, default="checkpoints/tsr_wrn")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


# --------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(F.dropout(F.relu(self.bn2(y)), self.drop, self.training))
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth, widen, num_classes, drop=0.3):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        blocks, cin = [], widths[0]
        for stage, (w, s) in enumerate(zip(widths[1:], (1, 2, 2))):
            for b in range(n):
                blocks.append(BasicBlock(cin, w, s if b == 0 else 1, drop))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


# --------------------------------------------------------------------- data
class NpzImages(Dataset):
    def __init__(self, path, transform):
        d = np.load(path)
        self.x = torch.from_numpy(d["images"]).permute(0, 3, 1, 2).contiguous()  # uint8 NCHW
        self.y = torch.from_numpy(d["labels"]).long()
        self.transform = transform

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


# --------------------------------------------------------------------- callbacks
class Callback:
    def on_epoch_end(self, trainer, epoch, logs): pass


class Checkpoint(Callback):
    def __init__(self, save_dir):
        self.save_dir, self.best = Path(save_dir), 0.0

    def on_epoch_end(self, trainer, epoch, logs):
        if dist.get_rank() != 0:
            return
        self.save_dir.mkdir(parents=True, exist_ok=True)
        state = {"epoch": epoch, "model": trainer.model.module.state_dict(),
                 "optimizer": trainer.optimizer.state_dict(), "acc": logs["test_acc"]}
        torch.save(state, self.save_dir / "last.pth")
        if logs["test_acc"] > self.best:
            self.best = logs["test_acc"]
            torch.save(state, self.save_dir / "best.pth")


class EarlyStop(Callback):
    def __init__(self, patience=15):
        self.patience, self.best, self.wait = patience, 0.0, 0

    def on_epoch_end(self, trainer, epoch, logs):
        if logs["test_acc"] > self.best:
            self.best, self.wait = logs["test_acc"], 0
        else:
            self.wait += 1
        if self.wait > self.patience:
            trainer.stop = True


class Printer(Callback):
    def on_epoch_end(self, trainer, epoch, logs):
        if dist.get_rank() == 0:
            lr = trainer.optimizer.param_groups[0]["lr"]
            logger.info("epoch %3d lr %.4f | %s", epoch, lr, " ".join(f"{k} {v:.4f}" for k, v in logs.items()))


# --------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, callbacks):
        self.device = device
        self.model = DDP(model.to(device), device_ids=[device.index], output_device=device.index)
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.stop = False

    def _allsum(self, *vals):
        t = torch.tensor(vals, device=self.device, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def train_epoch(self, loader):
        self.model.train()
        tot_loss, correct, n = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            out = self.model(x)
            loss = F.cross_entropy(out, y, label_smoothing=0.1)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            tot_loss += loss.item() * y.size(0)
            correct += (out.argmax(1) == y).sum().item()
            n += y.size(0)
        self.scheduler.step()
        tot_loss, correct, n = self._allsum(tot_loss, correct, n)
        return {"train_loss": tot_loss / n, "train_acc": correct / n}

    @torch.no_grad()
    def test(self, loader):
        net = self.model.module
        net.eval()
        correct, n = 0, 0
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            correct += (net(x).argmax(1) == y).sum().item()
            n += y.size(0)
        correct, n = self._allsum(correct, n)
        return {"test_acc": correct / n}

    def fit(self, train_loader, test_loader, epochs):
        for epoch in range(epochs):
            train_loader.sampler.set_epoch(epoch)
            t = time.time()
            logs = self.train_epoch(train_loader)
            logs.update(self.test(test_loader))
            logs["time"] = time.time() - t
            for cb in self.callbacks:
                cb.on_epoch_end(self, epoch, logs)
            if self.stop:
                break


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.backends.cudnn.benchmark = True

    mean, std = [0.34, 0.31, 0.32], [0.27, 0.26, 0.27]
    train_tf = T.Compose([T.RandomResizedCrop(48, scale=(0.8, 1.0), antialias=True),
                          T.RandomAffine(degrees=10, translate=(0.1, 0.1)), T.ColorJitter(0.3, 0.3, 0.3),
                          T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])
    train_set = NpzImages(os.path.join(args.data, "train.npz"), train_tf)
    test_set = NpzImages(os.path.join(args.data, "test.npz"), test_tf)
    train_loader = DataLoader(train_set, batch_size=args.batch_size,
                              sampler=DistributedSampler(train_set, shuffle=True, drop_last=True),
                              num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=256, num_workers=args.workers, pin_memory=True)

    model = WideResNet(args.depth, args.widen, num_classes=43)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    trainer = Trainer(model, optimizer, scheduler, device, [Printer(), Checkpoint(args.save_dir), EarlyStop()])
    trainer.fit(train_loader, test_loader, args.epochs)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
