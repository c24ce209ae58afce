"""MS-G3D style network with a single learnable topology shared by all layers.

The spatial-temporal (G3D) pathways unfold 3-frame windows, which makes
activations large at T=128, so every block after the stem is gradient-checkpointed.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_NODE = 25
NEIGHBOR = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
            (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
            (22, 23), (23, 8), (24, 25), (25, 12)]


def base_adjacency():
    A = np.eye(NUM_NODE, dtype=np.float32)
    for i, j in NEIGHBOR:
        A[i - 1, j - 1] = A[j - 1, i - 1] = 1
    return A


class SharedTopology(nn.Module):
    """Skeleton prior + one learned residual, normalised; used by every block."""

    def __init__(self):
        super().__init__()
        self.register_buffer("prior", torch.from_numpy(base_adjacency()))
        self.residual = nn.Parameter(torch.zeros(NUM_NODE, NUM_NODE))

    def spatial(self):
        a = F.relu(self.prior + self.residual)
        d = a.sum(-1).clamp(min=1e-6) ** -0.5
        return d[:, None] * a * d[None, :]

    def spatiotemporal(self, window=3):
        a = self.spatial()
        return a.repeat(window, window)              # (wV, wV): same graph across the window


class G3DBlock(nn.Module):
    def __init__(self, cin, cout, topo, stride=1, window=3):
        super().__init__()
        self.topo = topo
        self.window = window
        self.sgcn = nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.g3d = nn.Conv3d(cin, cout, (1, window, 1))
        self.g3d_bn = nn.BatchNorm2d(cout)
        self.tcn = nn.Sequential(nn.ReLU(True), nn.Conv2d(cout, cout, (5, 1), (stride, 1), (2, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        n, c, t, v = x.shape
        s = torch.einsum("nctu,vu->nctv", x, self.topo.spatial())
        s = self.sgcn(s)
        # G3D: unfold windows of `window` frames, aggregate over the window x V joints
        pad = self.window // 2
        xw = F.unfold(x, (self.window, 1), padding=(pad, 0))              # n, c*w, t*v
        xw = xw.view(n, c, self.window, t, v).permute(0, 1, 3, 2, 4).reshape(n, c, t, self.window * v)
        xw = torch.einsum("nctu,wu->nctw", xw, self.topo.spatiotemporal(self.window))
        xw = xw.view(n, c, t, self.window, v)
        g = self.g3d_bn(self.g3d(xw).squeeze(3))
        return F.relu(self.tcn(F.relu(s + g)) + self.res(x))


class MSG3D(nn.Module):
    def __init__(self, num_class=60, num_person=2, in_channels=3, use_checkpoint=True):
        super().__init__()
        self.topo = SharedTopology()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * NUM_NODE)
        plan = [(in_channels, 96, 1), (96, 96, 1), (96, 192, 2), (192, 192, 1), (192, 384, 2), (384, 384, 1)]
        self.blocks = nn.ModuleList([G3DBlock(a, b, self.topo, s) for a, b, s in plan])
        self.fc = nn.Linear(384, num_class)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for i, blk in enumerate(self.blocks):
            if self.use_checkpoint and self.training and i > 0:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        return self.fc(x.view(n, m, x.shape[1], -1).mean(-1).mean(1))


class NpyFeeder(Dataset):
    def __init__(self, root, split, window=128, train=False):
        self.x = np.load(f"{root}/{split}_data_joint.npy", mmap_mode="r")
        self.y = np.load(f"{root}/{split}_label.npy").astype(np.int64)
        self.window, self.train = window, train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = np.array(self.x[i], dtype=np.float32)
        t = max(int(np.any(x != 0, axis=(0, 2, 3)).sum()), 1)
        if self.train and t > 16:
            s = np.random.randint(0, t // 8 + 1)
            t_end = t - np.random.randint(0, t // 8 + 1)
        else:
            s, t_end = 0, t
        idx = np.linspace(s, max(t_end - 1, s), self.window).round().astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(x[:, idx])), self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/ntu/xsub")
    ap.add_argument("--out", default="work_dir/msg3d_shared_xsub")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32, help="global batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--no-checkpoint", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = NpyFeeder(args.data, "train", train=True)
    val_set = NpyFeeder(args.data, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=32, num_workers=8, pin_memory=True)

    net = MSG3D(60, use_checkpoint=not args.no_checkpoint)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 40], gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        meter = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)

        if rank == 0:
            net.eval()
            c1 = c5 = tot = 0
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    p = net(x).topk(5, 1).indices
                    c1 += (p[:, 0] == y).sum().item()
                    c5 += (p == y[:, None]).any(1).sum().item()
                    tot += y.numel()
            print(f"epoch {epoch + 1} loss {(meter[0] / meter[1]).item():.4f} top1 {c1 / tot:.4f} "
                  f"top5 {c5 / tot:.4f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(args.out, "last.pt"))
            if c1 / tot > best:
                best = c1 / tot
                torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
