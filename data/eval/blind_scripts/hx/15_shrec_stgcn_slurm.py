#!/usr/bin/env python
"""ST-GCN on SHREC'17 hand-gesture skeletons (14 / 28 gesture protocol).

One Slurm task per GPU; the sbatch wrapper exports MASTER_ADDR and runs

    srun --ntasks-per-node=4 --gpus-per-node=4 python 15_shrec_stgcn_slurm.py --cfg configs/shrec14.yaml

The work dir lives under $HOME (NFS), so every node sees the same checkpoints.
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

NUM_JOINTS = 22
# 0 wrist, 1 palm, thumb 2-5, index 6-9, middle 10-13, ring 14-17, pinky 18-21
HAND_EDGES = [(0, 1), (0, 2), (2, 3), (3, 4), (4, 5),
              (1, 6), (6, 7), (7, 8), (8, 9),
              (1, 10), (10, 11), (11, 12), (12, 13),
              (1, 14), (14, 15), (15, 16), (16, 17),
              (1, 18), (18, 19), (19, 20), (20, 21)]


def build_adjacency(num_nodes, edges):
    A = np.zeros((3, num_nodes, num_nodes), dtype=np.float32)
    A[0] = np.eye(num_nodes)
    for i, j in edges:
        A[1, j, i] = 1.0  # inward
        A[2, i, j] = 1.0  # outward
    for k in (1, 2):
        deg = A[k].sum(0)
        deg[deg == 0] = 1.0
        A[k] = A[k] / deg[None, :]
    return torch.from_numpy(A)


class ShrecSkeletons(Dataset):
    """Pre-extracted sequences: list of dicts {"joints": (T, 22, 3), "label14", "label28", "subject"}."""

    def __init__(self, pkl_path, num_frames=32, protocol=14, train=True):
        with open(pkl_path, "rb") as f:
            self.samples = pickle.load(f)
        self.num_frames = num_frames
        self.key = "label14" if protocol == 14 else "label28"
        self.train = train

    def __len__(self):
        return len(self.samples)

    def _sample_frames(self, length):
        # segment-based sampling: one frame per equal-length segment
        edges = np.linspace(0, length, self.num_frames + 1)
        if self.train:
            idx = [np.random.randint(int(a), max(int(a) + 1, int(b))) for a, b in zip(edges[:-1], edges[1:])]
        else:
            idx = ((edges[:-1] + edges[1:]) / 2).astype(int)
        return np.clip(np.asarray(idx), 0, length - 1)

    def __getitem__(self, i):
        s = self.samples[i]
        joints = s["joints"].astype(np.float32)
        joints = joints[self._sample_frames(len(joints))]
        joints = joints - joints[:1, 1:2, :]  # palm of first frame at the origin
        if self.train:
            theta = np.random.uniform(-0.3, 0.3)
            rot = np.array([[np.cos(theta), -np.sin(theta), 0],
                            [np.sin(theta), np.cos(theta), 0],
                            [0, 0, 1]], dtype=np.float32)
            joints = joints @ rot.T * np.random.uniform(0.9, 1.1)
        x = torch.from_numpy(joints).permute(2, 0, 1).contiguous()  # C, T, V
        return x, int(s[self.key])


class GraphConv(nn.Module):
    def __init__(self, cin, cout, A):
        super().__init__()
        self.register_buffer("A", A)
        self.edge_importance = nn.Parameter(torch.ones_like(A))
        self.conv = nn.Conv2d(cin, cout * A.size(0), 1)
        self.k = A.size(0)

    def forward(self, x):
        n, _, t, v = x.shape
        x = self.conv(x).view(n, self.k, -1, t, v)
        return torch.einsum("nkctv,kvw->nctw", x, self.A * self.edge_importance)


class STGCNBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1, dropout=0.1):
        super().__init__()
        self.gcn = GraphConv(cin, cout, A)
        self.tcn = nn.Sequential(
            nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)),
            nn.BatchNorm2d(cout), nn.Dropout(dropout))
        if cin == cout and stride == 1:
            self.res = nn.Identity()
        else:
            self.res = nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.tcn(self.gcn(x)) + self.res(x))


class STGCN(nn.Module):
    def __init__(self, num_classes, A, in_ch=3, widths=(64, 64, 128, 128, 256, 256)):
        super().__init__()
        self.data_bn = nn.BatchNorm1d(in_ch * A.size(1))
        layers, cin = [], in_ch
        for i, w in enumerate(widths):
            stride = 2 if i in (2, 4) else 1
            layers.append(STGCNBlock(cin, w, A, stride))
            cin = w
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        n, c, t, v = x.shape
        x = self.data_bn(x.permute(0, 1, 3, 2).reshape(n, c * v, t))
        x = x.view(n, c, v, t).permute(0, 1, 3, 2)
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


def setup_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0) + rank)
    np.random.seed(cfg.get("seed", 0) + rank)

    train_set = ShrecSkeletons(cfg["train_pkl"], cfg["num_frames"], cfg["protocol"], train=True)
    val_set = ShrecSkeletons(cfg["val_pkl"], cfg["num_frames"], cfg["protocol"], train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=train_sampler,
                              num_workers=cfg.get("workers", 4), pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shard without padding, so every validation sequence is counted exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_shard, batch_size=64, shuffle=False, num_workers=2, pin_memory=True)

    A = build_adjacency(NUM_JOINTS, HAND_EDGES)
    model = STGCN(cfg["protocol"], A).to(device)
    # per-GPU batches are small (8-16 sequences), so share BN statistics across GPUs
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = cfg["batch_per_gpu"] * world_size
    lr = cfg["base_lr"] * global_batch / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                                weight_decay=cfg.get("weight_decay", 5e-4))
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=cfg["epochs"],
                                                    steps_per_epoch=steps_per_epoch, pct_start=0.1)

    work_dir = os.path.expanduser(cfg["work_dir"])
    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    writer = None
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(work_dir, "tb"))
        print(f"world={world_size} global_batch={global_batch} lr={lr:.4f} steps/epoch={steps_per_epoch}")

    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach() * y.numel()
            running[1] += y.numel()

        dist.all_reduce(running)
        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            train_loss = (running[0] / running[1]).item()
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            writer.add_scalar("lr", scheduler.get_last_lr()[0], epoch)
            print(f"epoch {epoch:3d} train_loss {train_loss:.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc * 100:.2f} ({time.time() - t0:.0f}s)")
            is_best = val_acc > best_acc
            best_acc = max(best_acc, val_acc)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                     "cfg": cfg}
            torch.save(state, os.path.join(work_dir, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(work_dir, "best.pth"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"best val acc {best_acc * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
