"""ST-GCN on NTU RGB+D from per-sample skeleton arrays.

Each sample is stored as <skeleton_dir>/SsssCcccPpppRrrrAaaa.npy with shape
(C=3, T, V=25, M=2) written by tools/ntu_read_skeleton.py.
"""
import argparse
import glob
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

TRAIN_SUBJECTS = [1, 2, 4, 5, 8, 9, 13, 14, 15, 16, 17, 18, 19, 25, 27, 28, 31, 34, 35, 38]
TRAIN_CAMERAS = [2, 3]


class Graph:
    """Spatial-configuration partitioning from the ST-GCN paper."""

    def __init__(self, center=20, max_hop=1):
        self.num_node = 25
        pairs = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21),
                 (10, 9), (11, 10), (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1),
                 (18, 17), (19, 18), (20, 19), (22, 23), (23, 8), (24, 25), (25, 12)]
        edges = [(i, i) for i in range(self.num_node)] + [(i - 1, j - 1) for i, j in pairs]
        adj = np.zeros((self.num_node, self.num_node))
        for i, j in edges:
            adj[i, j] = adj[j, i] = 1
        hop = np.full((self.num_node, self.num_node), np.inf)
        powers = [np.linalg.matrix_power(adj, d) for d in range(max_hop + 1)]
        for d in range(max_hop, -1, -1):
            hop[powers[d] > 0] = d
        norm = adj / adj.sum(0, keepdims=True)
        root, close, far = (np.zeros_like(adj) for _ in range(3))
        for i in range(self.num_node):
            for j in range(self.num_node):
                if hop[j, i] != 1 and hop[j, i] != 0:
                    continue
                if hop[j, center] == hop[i, center]:
                    root[j, i] = norm[j, i]
                elif hop[j, center] > hop[i, center]:
                    close[j, i] = norm[j, i]
                else:
                    far[j, i] = norm[j, i]
        self.A = np.stack([root, close, far]).astype(np.float32)


class STGCNBlock(nn.Module):
    def __init__(self, cin, cout, K, stride=1, dropout=0.0, residual=True):
        super().__init__()
        self.K = K
        self.gcn = nn.Conv2d(cin, cout * K, 1)
        self.tcn = nn.Sequential(
            nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)),
            nn.BatchNorm2d(cout), nn.Dropout(dropout, inplace=True))
        if not residual:
            self.residual = lambda x: 0
        elif cin == cout and stride == 1:
            self.residual = nn.Identity()
        else:
            self.residual = nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout))

    def forward(self, x, A):
        res = self.residual(x)
        n, _, t, v = x.shape
        x = self.gcn(x).view(n, self.K, -1, t, v)
        x = torch.einsum("nkctv,kvw->nctw", x, A)
        return F.relu(self.tcn(x) + res)


class STGCN(nn.Module):
    def __init__(self, num_class, in_channels=3, edge_importance=True, dropout=0.5):
        super().__init__()
        A = torch.tensor(Graph().A)
        self.register_buffer("A", A)
        K, V = A.shape[0], A.shape[1]
        self.data_bn = nn.BatchNorm1d(in_channels * V)
        spec = [(in_channels, 64, 1, False), (64, 64, 1, True), (64, 64, 1, True), (64, 64, 1, True),
                (64, 128, 2, True), (128, 128, 1, True), (128, 128, 1, True),
                (128, 256, 2, True), (256, 256, 1, True), (256, 256, 1, True)]
        self.blocks = nn.ModuleList([STGCNBlock(ci, co, K, s, dropout if i else 0.0, r)
                                     for i, (ci, co, s, r) in enumerate(spec)])
        if edge_importance:
            self.importance = nn.ParameterList([nn.Parameter(torch.ones(A.shape)) for _ in self.blocks])
        else:
            self.importance = [1.0] * len(self.blocks)
        self.fcn = nn.Conv2d(256, num_class, 1)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = x.permute(0, 4, 3, 1, 2).reshape(n * m, v * c, t)
        x = self.data_bn(x)
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for blk, imp in zip(self.blocks, self.importance):
            x = blk(x, self.A * imp)
        x = F.avg_pool2d(x, x.shape[2:]).view(n, m, -1, 1, 1).mean(1)
        return self.fcn(x).flatten(1)


def parse_name(fname):
    base = osp.basename(fname)
    setup = int(base[base.find("S") + 1:base.find("S") + 4])
    camera = int(base[base.find("C") + 1:base.find("C") + 4])
    subject = int(base[base.find("P") + 1:base.find("P") + 4])
    action = int(base[base.find("A") + 1:base.find("A") + 4])
    return setup, camera, subject, action


class NTUSkeletonFolder(Dataset):
    def __init__(self, root, benchmark, part, max_frame=300, ignore_file=None):
        ignored = set()
        if ignore_file and osp.exists(ignore_file):
            with open(ignore_file) as f:
                ignored = {line.strip() for line in f if line.strip()}
        self.files, self.labels = [], []
        for path in sorted(glob.glob(osp.join(root, "*.npy"))):
            name = osp.basename(path).split(".")[0]
            if name in ignored:
                continue
            _, camera, subject, action = parse_name(name)
            if benchmark == "xview":
                is_train = camera in TRAIN_CAMERAS
            else:
                is_train = subject in TRAIN_SUBJECTS
            if is_train == (part == "train"):
                self.files.append(path)
                self.labels.append(action)
        self.max_frame = max_frame

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = np.load(self.files[i]).astype(np.float32)
        out = np.zeros((3, self.max_frame, 25, 2), dtype=np.float32)
        t = min(x.shape[1], self.max_frame)
        out[:, :t, :, :x.shape[3]] = x[:, :t, :, :2]
        # centre on the spine joint of the first frame
        out[:, :t] -= out[:, :1, 1:2, :1]
        return torch.from_numpy(out), self.labels[i]


class ShardSampler(Sampler):
    """Every sample exactly once across ranks (no padding), for exact test accuracy."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="config/st_gcn/ntu-xsub/train.yaml")
    ap.add_argument("--work_dir", default=None)
    cli = ap.parse_args()
    with open(cli.config) as f:
        cfg = yaml.safe_load(f)
    work_dir = cli.work_dir or cfg["work_dir"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    dcfg = cfg["feeder"]
    train_set = NTUSkeletonFolder(dcfg["root"], dcfg["benchmark"], "train", ignore_file=dcfg.get("ignore"))
    test_set = NTUSkeletonFolder(dcfg["root"], dcfg["benchmark"], "val", ignore_file=dcfg.get("ignore"))
    per_gpu = cfg["batch_size"] // world
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=cfg.get("num_worker", 8), pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=cfg.get("test_batch_size", 64) // world,
                             sampler=ShardSampler(len(test_set), rank, world),
                             num_workers=cfg.get("num_worker", 8), pin_memory=True)

    model = STGCN(num_class=cfg["model"]["num_class"], dropout=cfg["model"].get("dropout", 0.5)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["base_lr"], momentum=0.9,
                                nesterov=True, weight_decay=cfg.get("weight_decay", 1e-4))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg["step"], gamma=0.1)

    writer = SummaryWriter(osp.join(work_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
        with open(osp.join(work_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    global_step = 0
    for epoch in range(cfg["num_epoch"]):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
        scheduler.step()

        if (epoch + 1) % cfg.get("eval_interval", 5) == 0 or epoch + 1 == cfg["num_epoch"]:
            net = model.module
            net.eval()
            stats = torch.zeros(3, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    top5 = net(x).topk(5, 1).indices
                    stats[0] += (top5[:, 0] == y).sum()
                    stats[1] += (top5 == y[:, None]).any(1).sum()
                    stats[2] += y.numel()
            dist.all_reduce(stats)
            top1, top5 = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
            if rank == 0:
                print(f"[epoch {epoch + 1}] top1 {top1:.4f} top5 {top5:.4f} time {time.time() - tic:.0f}s", flush=True)
                writer.add_scalar("test/top1", top1, epoch + 1)
                writer.add_scalar("test/top5", top5, epoch + 1)

        if rank == 0 and (epoch + 1) % cfg.get("save_interval", 10) == 0:
            torch.save(model.module.state_dict(), osp.join(work_dir, f"epoch{epoch + 1}_model.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
