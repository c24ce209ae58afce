#!/usr/bin/env python
"""CTR-GCN style training on NTU RGB+D 60 (cross-subject / cross-view).

Expects the preprocessed .npz produced by the usual seq_transformation step:
    x_train: (N, T, 150), y_train: (N, 60) one-hot, same for x_test / y_test.
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

NUM_NODE = 25
INWARD = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7),
          (9, 21), (10, 9), (11, 10), (12, 11), (13, 1), (14, 13), (15, 14),
          (16, 15), (17, 1), (18, 17), (19, 18), (20, 19), (22, 23), (23, 8),
          (24, 25), (25, 12)]


def spatial_graph():
    inward = [(i - 1, j - 1) for i, j in INWARD]
    eye = np.eye(NUM_NODE, dtype=np.float32)
    a_in = np.zeros((NUM_NODE, NUM_NODE), dtype=np.float32)
    for i, j in inward:
        a_in[j, i] = 1.0
    a_out = a_in.T.copy()

    def norm(a):
        d = a.sum(0)
        d[d == 0] = 1.0
        return a / d

    return np.stack([eye, norm(a_in), norm(a_out)])


class NTUFeeder(Dataset):
    def __init__(self, path, split, window=64, random_rot=False):
        npz = np.load(path)
        x = npz["x_train" if split == "train" else "x_test"]
        y = npz["y_train" if split == "train" else "y_test"]
        n, t, _ = x.shape
        self.data = x.reshape(n, t, 2, NUM_NODE, 3).transpose(0, 4, 1, 3, 2)
        self.label = np.where(y > 0)[1]
        self.window = window
        self.random_rot = random_rot
        self.train = split == "train"

    def __len__(self):
        return len(self.label)

    def _valid_len(self, seq):
        nz = (seq != 0).sum(axis=(0, 2, 3)) > 0
        return max(int(nz.sum()), 1)

    def __getitem__(self, idx):
        seq = self.data[idx]
        t_valid = self._valid_len(seq)
        seq = seq[:, :t_valid]
        if self.train:
            crop = np.random.uniform(0.5, 1.0)
            length = max(int(t_valid * crop), 8)
            start = np.random.randint(0, t_valid - length + 1)
            seq = seq[:, start:start + length]
        seq = torch.from_numpy(np.ascontiguousarray(seq)).float()
        seq = F.interpolate(seq.permute(0, 2, 3, 1).reshape(1, -1, seq.shape[1]),
                            size=self.window, mode="linear", align_corners=False)
        seq = seq.reshape(3, NUM_NODE, 2, self.window).permute(0, 3, 1, 2).contiguous()
        if self.random_rot:
            theta = torch.empty(3).uniform_(-0.3, 0.3)
            c, s = torch.cos(theta).tolist(), torch.sin(theta).tolist()
            rx = torch.tensor([[1, 0, 0], [0, c[0], s[0]], [0, -s[0], c[0]]])
            ry = torch.tensor([[c[1], 0, -s[1]], [0, 1, 0], [s[1], 0, c[1]]])
            rz = torch.tensor([[c[2], s[2], 0], [-s[2], c[2], 0], [0, 0, 1]])
            rot = rz @ ry @ rx
            seq = torch.einsum("ij,jtvm->itvm", rot, seq)
        return seq, int(self.label[idx])


class CTRGC(nn.Module):
    def __init__(self, cin, cout, rel_reduction=8):
        super().__init__()
        rel = max(cin // rel_reduction, 8) if cin > 3 else 8
        self.conv1 = nn.Conv2d(cin, rel, 1)
        self.conv2 = nn.Conv2d(cin, rel, 1)
        self.conv3 = nn.Conv2d(cin, cout, 1)
        self.conv4 = nn.Conv2d(rel, cout, 1)

    def forward(self, x, a, alpha):
        x1 = self.conv1(x).mean(-2)
        x2 = self.conv2(x).mean(-2)
        x3 = self.conv3(x)
        rel = torch.tanh(x1.unsqueeze(-1) - x2.unsqueeze(-2))
        rel = self.conv4(rel) * alpha + a.unsqueeze(0).unsqueeze(0)
        return torch.einsum("ncuv,nctv->nctu", rel, x3)


class Block(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.A = nn.Parameter(torch.from_numpy(A.copy()))
        self.alpha = nn.Parameter(torch.zeros(1))
        self.gcs = nn.ModuleList([CTRGC(cin, cout) for _ in range(A.shape[0])])
        self.bn_g = nn.BatchNorm2d(cout)
        self.tcn = nn.Sequential(
            nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)),
            nn.BatchNorm2d(cout),
        )
        if cin == cout and stride == 1:
            self.res = nn.Identity()
        else:
            self.res = nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout))
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = sum(gc(x, self.A[i], self.alpha) for i, gc in enumerate(self.gcs))
        y = F.relu(self.bn_g(y) + self.down(x))
        return F.relu(self.tcn(y) + self.res(x))


class CTRGCN(nn.Module):
    def __init__(self, num_class=60, in_channels=3, num_person=2, drop_out=0.0):
        super().__init__()
        A = spatial_graph()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * NUM_NODE)
        chans = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1),
                 (64, 128, 2), (128, 128, 1), (128, 128, 1),
                 (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.layers = nn.ModuleList([Block(ci, co, A, s) for ci, co, s in chans])
        self.drop = nn.Dropout(drop_out)
        self.fc = nn.Linear(256, num_class)
        nn.init.normal_(self.fc.weight, 0, math.sqrt(2.0 / num_class))

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t)
        x = self.data_bn(x)
        x = x.reshape(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for layer in self.layers:
            x = layer(x)
        x = x.reshape(n, m, x.shape[1], -1).mean(3).mean(1)
        return self.fc(self.drop(x))


def adjust_lr(optimizer, epoch, step, steps_per_epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * (epoch * steps_per_epoch + step + 1) / (args.warmup_epochs * steps_per_epoch)
    else:
        lr = args.lr * (0.1 ** sum(epoch >= s for s in args.steps))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct1 = correct5 = total = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        correct1 += (top5[:, 0] == y).sum().item()
        correct5 += (top5 == y[:, None]).any(1).sum().item()
        total += y.numel()
    return correct1 / total, correct5 / total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/ntu/NTU60_CS.npz")
    p.add_argument("--work-dir", default="work_dir/ntu60/xsub/ctrgcn_joint")
    p.add_argument("--epochs", type=int, default=65)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=4e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--steps", type=int, nargs="+", default=[35, 55])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    args.lr = args.lr * args.batch_size * world / 64

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = NTUFeeder(args.data, "train", args.window, random_rot=True)
    test_set = NTUFeeder(args.data, "test", args.window)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=256, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = CTRGCN(num_class=60).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                nesterov=True, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"world={world} train={len(train_set)} test={len(test_set)} lr={args.lr:.4f}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            lr = adjust_lr(optimizer, epoch, step, len(train_loader), args)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(loss_sum)

        if rank == 0:
            top1, top5 = evaluate(model.module, test_loader, device)
            print(f"epoch {epoch + 1:3d} lr {lr:.5f} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"top1 {top1 * 100:.2f} top5 {top5 * 100:.2f} ({time.time() - tic:.0f}s)", flush=True)
            state = {"epoch": epoch + 1, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "top1": top1}
            torch.save(state, os.path.join(args.work_dir, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.work_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best top1 {best * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
