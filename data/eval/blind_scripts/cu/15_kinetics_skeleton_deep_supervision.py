"""ST-GCN on Kinetics-Skeleton (OpenPose 18 joints, 400 classes) with optional deep supervision.

Config (yaml) keys: data_dir, work_dir, batch_size (global), base_lr, epochs, step,
window, aux_weight (weight of the mid-level auxiliary classifier; 0 disables it).
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OPENPOSE_EDGES = [(4, 3), (3, 2), (7, 6), (6, 5), (13, 12), (12, 11), (10, 9), (9, 8), (11, 5),
                  (8, 2), (5, 1), (2, 1), (0, 1), (15, 0), (14, 0), (17, 15), (16, 14)]
NUM_NODE = 18


def openpose_A(center=1):
    adj = np.eye(NUM_NODE)
    for i, j in OPENPOSE_EDGES:
        adj[i, j] = adj[j, i] = 1
    dist_to_c = np.full(NUM_NODE, np.inf)
    dist_to_c[center] = 0
    for _ in range(NUM_NODE):
        for i, j in OPENPOSE_EDGES:
            dist_to_c[i] = min(dist_to_c[i], dist_to_c[j] + 1)
            dist_to_c[j] = min(dist_to_c[j], dist_to_c[i] + 1)
    norm = adj / adj.sum(0, keepdims=True)
    A = np.zeros((3, NUM_NODE, NUM_NODE), dtype=np.float32)
    for i in range(NUM_NODE):
        for j in range(NUM_NODE):
            if adj[j, i] == 0:
                continue
            if dist_to_c[j] == dist_to_c[i]:
                A[0, j, i] = norm[j, i]
            elif dist_to_c[j] > dist_to_c[i]:
                A[1, j, i] = norm[j, i]
            else:
                A[2, j, i] = norm[j, i]
    return A


class KineticsFeeder(Dataset):
    def __init__(self, data_path, label_path, window=150, train=True):
        self.data = np.load(data_path, mmap_mode="r")              # N, 3, 300, 18, 2
        with open(label_path, "rb") as f:
            self.names, self.labels = pickle.load(f)
        self.window, self.train = window, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = np.array(self.data[i], dtype=np.float32)
        t = max(int((x[2].sum(axis=(1, 2)) > 0).sum()), 1)     # frames with any confident joint
        x = x[:, :t]
        if self.train:
            # random shift / random choose, as in st-gcn tools
            if t >= self.window:
                s = np.random.randint(0, t - self.window + 1)
                x = x[:, s:s + self.window]
            else:
                pad = np.zeros((3, self.window, NUM_NODE, 2), dtype=np.float32)
                s = np.random.randint(0, self.window - t + 1)
                pad[:, s:s + t] = x
                x = pad
            x[:2] += np.random.normal(0, 0.005, x[:2].shape).astype(np.float32)
        else:
            idx = np.linspace(0, t - 1, self.window).round().astype(np.int64)
            x = x[:, idx]
        # keep the two most confident people
        order = np.argsort(-x[2].sum(axis=(0, 1)))
        return torch.from_numpy(np.ascontiguousarray(x[..., order])), int(self.labels[i])


class Block(nn.Module):
    def __init__(self, cin, cout, A, stride=1, dropout=0.5):
        super().__init__()
        self.K = A.shape[0]
        self.register_buffer("A", torch.from_numpy(A))
        self.edge_importance = nn.Parameter(torch.ones_like(self.A))
        self.gcn = nn.Conv2d(cin, cout * self.K, 1)
        self.tcn = nn.Sequential(nn.BatchNorm2d(cout), nn.ReLU(True),
                                 nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)),
                                 nn.BatchNorm2d(cout), nn.Dropout(dropout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        n, _, t, v = x.shape
        y = self.gcn(x).view(n, self.K, -1, t, v)
        y = torch.einsum("nkctv,kvw->nctw", y, self.A * self.edge_importance)
        return F.relu(self.tcn(y) + self.res(x))


class STGCNDS(nn.Module):
    def __init__(self, num_class=400, aux_weight=0.0):
        super().__init__()
        A = openpose_A()
        self.aux_weight = aux_weight
        self.data_bn = nn.BatchNorm1d(3 * NUM_NODE)
        self.stage1 = nn.Sequential(Block(3, 64, A, dropout=0), Block(64, 64, A), Block(64, 64, A), Block(64, 64, A))
        self.stage2 = nn.Sequential(Block(64, 128, A, 2), Block(128, 128, A), Block(128, 128, A))
        self.stage3 = nn.Sequential(Block(128, 256, A, 2), Block(256, 256, A), Block(256, 256, A))
        self.aux_head = nn.Linear(128, num_class)
        self.fc = nn.Linear(256, num_class)

    def _pool(self, x, n, m):
        return x.view(n, m, x.shape[1], -1).mean(-1).mean(1)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n * m, v * c, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        mid = self.stage2(self.stage1(x))
        out = self.fc(self._pool(self.stage3(mid), n, m))
        if self.training and self.aux_weight > 0:
            return out, self.aux_head(self._pool(mid, n, m))
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kinetics_stgcn_ds.yaml")
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    d = cfg["data_dir"]
    train_set = KineticsFeeder(f"{d}/train_data.npy", f"{d}/train_label.pkl", cfg.get("window", 150), True)
    val_set = KineticsFeeder(f"{d}/val_data.npy", f"{d}/val_label.pkl", cfg.get("window", 150), False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"] // world, sampler=train_sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=128,
                            num_workers=cfg.get("workers", 8), pin_memory=True)

    aux_weight = float(cfg.get("aux_weight", 0.0))
    model = STGCNDS(400, aux_weight=aux_weight).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["base_lr"], momentum=0.9, nesterov=True,
                                weight_decay=cfg.get("weight_decay", 1e-4))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg["step"], gamma=0.1)

    work_dir = cfg["work_dir"]
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            if isinstance(out, tuple):
                logits, aux = out
                loss = F.cross_entropy(logits, y) + aux_weight * F.cross_entropy(aux, y)
            else:
                loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch + 1} iter {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        net = model.module
        net.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                p5 = net(x).topk(5, 1).indices
                acc[0] += (p5[:, 0] == y).sum()
                acc[1] += (p5 == y[:, None]).any(1).sum()
                acc[2] += y.numel()
        dist.all_reduce(acc)
        top1, top5 = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            print(f"epoch {epoch + 1} val top1 {top1:.4f} top5 {top5:.4f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch + 1, "state_dict": net.state_dict()}, os.path.join(work_dir, "latest.pth"))
            if top1 > best:
                best = top1
                torch.save({"epoch": epoch + 1, "state_dict": net.state_dict()}, os.path.join(work_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
