"""Shift-GCN (joint) on NTU RGB+D 120 X-Set with preemption-safe resume.

The cluster kills jobs after 24h, so the launcher script re-submits with
--resume <work_dir>/latest.pt until the schedule is done.
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

NUM_JOINT = 25


class NTUArray(Dataset):
    def __init__(self, root, split, window=64, train=False):
        self.x = np.load(os.path.join(root, f"{split}_data.npy"), mmap_mode="r")   # N, C, T, V, M
        self.y = np.load(os.path.join(root, f"{split}_label.npy")).astype(np.int64)
        self.window, self.train = window, train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = np.asarray(self.x[i], dtype=np.float32)
        t = max(int((np.abs(x).sum((0, 2, 3)) > 0).sum()), 1)
        if self.train:
            seg = np.linspace(0, t, self.window + 1).astype(np.int64)
            idx = np.array([np.random.randint(a, max(b, a + 1)) for a, b in zip(seg[:-1], seg[1:])])
            idx = np.minimum(idx, t - 1)
        else:
            idx = np.linspace(0, t - 1, self.window).round().astype(np.int64)
        return torch.from_numpy(x[:, idx]), self.y[i]


class EvenShard(Sampler):
    def __init__(self, n, rank, world):
        self.indices = np.array_split(np.arange(n), world)[rank].tolist()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class ShiftGCNUnit(nn.Module):
    """Non-local spatial shift: channel c of joint v is read from joint (v + c) % V."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.cin, self.cout = cin, cout
        self.lin = nn.Linear(cin, cout)
        self.mask = nn.Parameter(torch.ones(1, NUM_JOINT, cin))
        self.bn = nn.BatchNorm1d(NUM_JOINT * cout)
        v = torch.arange(NUM_JOINT).view(-1, 1)
        shift_in = ((v + torch.arange(cin).view(1, -1)) % NUM_JOINT) * cin + torch.arange(cin).view(1, -1)
        shift_out = ((v - torch.arange(cout).view(1, -1)) % NUM_JOINT) * cout + torch.arange(cout).view(1, -1)
        self.register_buffer("shift_in", shift_in.flatten())
        self.register_buffer("shift_out", shift_out.flatten())
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x0):
        n, c, t, v = x0.shape
        x = x0.permute(0, 2, 3, 1).reshape(n * t, v * c)
        x = x.index_select(1, self.shift_in).view(n * t, v, c)
        x = x * (torch.tanh(self.mask) + 1)
        x = self.lin(x).reshape(n * t, -1)
        x = x.index_select(1, self.shift_out)
        x = self.bn(x.view(n, t, -1).transpose(1, 2)).transpose(1, 2)
        x = x.reshape(n, t, v, self.cout).permute(0, 3, 1, 2)
        x = F.relu(x + self.down(x0))
        return F.relu(self.tcn(x) + self.res(x0))


class ShiftGCN(nn.Module):
    def __init__(self, num_class=120, in_channels=3, num_person=2):
        super().__init__()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * NUM_JOINT)
        plan = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2),
                (128, 128, 1), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.body = nn.Sequential(*[ShiftGCNUnit(a, b, s) for a, b, s in plan])
        self.fc = nn.Linear(256, num_class)
        nn.init.normal_(self.fc.weight, 0, math.sqrt(2.0 / num_class))

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        x = self.body(x)
        return self.fc(x.view(n, m, x.size(1), -1).mean(3).mean(1))


def lr_at(epoch, args):
    if epoch < args.warmup:
        return args.lr * (epoch + 1) / args.warmup
    return args.lr * 0.1 ** sum(epoch >= m for m in args.milestones)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    out = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.cuda(device, non_blocking=True), y.cuda(device, non_blocking=True)
        pred5 = model(x).topk(5, -1).indices
        out += torch.stack([(pred5[:, 0] == y).sum(), (pred5 == y.unsqueeze(1)).any(1).sum(),
                            torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(out)
    return (out[0] / out[2]).item(), (out[1] / out[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/ntu120/xset")
    ap.add_argument("--work-dir", default="work_dir/ntu120_xset_shiftgcn_joint")
    ap.add_argument("--resume", default="")
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--milestones", type=int, nargs="+", default=[60, 80, 100])
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = NTUArray(args.data, "train", train=True)
    test_set = NTUArray(args.data, "val")
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=64, sampler=EvenShard(len(test_set), rank, world),
                             num_workers=args.num_workers, pin_memory=True)

    net = ShiftGCN().cuda()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])
    args.lr = args.lr * world * args.batch_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"], ckpt["best_top1"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch} (best {best:.4f})", flush=True)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(epoch, args)
        model.train()
        tic, loss_acc = time.time(), torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        dist.all_reduce(loss_acc)
        top1, top5 = evaluate(net, test_loader, device)
        best = max(best, top1)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} lr {optimizer.param_groups[0]['lr']:.4f} "
                  f"loss {(loss_acc[0] / loss_acc[1]).item():.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"best {best:.4f} {time.time() - tic:.0f}s", flush=True)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch + 1, "best_top1": best}
            tmp = os.path.join(args.work_dir, "latest.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(args.work_dir, "latest.pt"))
            if top1 == best:
                torch.save(net.state_dict(), os.path.join(args.work_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
