"""DGCNN classification on ModelNet40 (1024 pts, normals off).

Cluster job (job.sbatch):
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29511
    srun python 17_pointnet_slurm.py --data /scratch/modelnet40_ply_hdf5_2048
"""
import argparse
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/scratch/modelnet40_ply_hdf5_2048")
    ap.add_argument("--npoints", type=int, default=1024)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", default="/scratch/$USER/dgcnn")
    return ap.parse_args()


def setup_distributed():
    world_size = int(os.environ.get("SLURM_NTASKS", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)
    return rank, local_rank, world_size


class ModelNet40H5(Dataset):
    def __init__(self, root, split, npoints):
        data, label = [], []
        for f in sorted(glob.glob(os.path.join(root, f"ply_data_{split}*.h5"))):
            with h5py.File(f, "r") as h:
                data.append(h["data"][:].astype(np.float32))
                label.append(h["label"][:].astype(np.int64))
        self.data, self.label = np.concatenate(data), np.concatenate(label).squeeze(-1)
        self.npoints, self.train = npoints, split == "train"

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        pc = self.data[i][:self.npoints].copy()
        if self.train:
            pc = pc * np.random.uniform(2 / 3, 3 / 2, 3) + np.random.uniform(-0.2, 0.2, 3)
            np.random.shuffle(pc)
        return torch.from_numpy(pc.astype(np.float32)), self.label[i]


def knn_feature(x, k):
    # x: B C N -> B 2C N k
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = (x ** 2).sum(1, keepdim=True)
    idx = (-xx - inner - xx.transpose(2, 1)).topk(k=k, dim=-1)[1]  # B N k
    B, C, N = x.shape
    base = torch.arange(B, device=x.device).view(-1, 1, 1) * N
    idx = (idx + base).view(-1)
    xt = x.transpose(2, 1).contiguous()
    feat = xt.view(B * N, -1)[idx].view(B, N, k, C)
    xt = xt.view(B, N, 1, C).expand(-1, -1, k, -1)
    return torch.cat([feat - xt, xt], 3).permute(0, 3, 1, 2).contiguous()


class DGCNN(nn.Module):
    def __init__(self, k=20, emb=1024, n_cls=40):
        super().__init__()
        self.k = k

        def block(ci, co):
            return nn.Sequential(nn.Conv2d(ci, co, 1, bias=False), nn.BatchNorm2d(co), nn.LeakyReLU(0.2))

        self.e1, self.e2, self.e3, self.e4 = block(6, 64), block(128, 64), block(128, 128), block(256, 256)
        self.conv5 = nn.Sequential(nn.Conv1d(512, emb, 1, bias=False), nn.BatchNorm1d(emb), nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Linear(emb * 2, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(0.5),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(0.5),
            nn.Linear(256, n_cls))

    def forward(self, x):
        x = x.transpose(1, 2)
        x1 = self.e1(knn_feature(x, self.k)).max(-1)[0]
        x2 = self.e2(knn_feature(x1, self.k)).max(-1)[0]
        x3 = self.e3(knn_feature(x2, self.k)).max(-1)[0]
        x4 = self.e4(knn_feature(x3, self.k)).max(-1)[0]
        x = self.conv5(torch.cat([x1, x2, x3, x4], 1))
        x = torch.cat([x.max(-1)[0], x.mean(-1)], 1)
        return self.head(x)


def smooth_ce(pred, gold, eps=0.2):
    n = pred.size(1)
    one_hot = torch.zeros_like(pred).scatter(1, gold.view(-1, 1), 1)
    one_hot = one_hot * (1 - eps) + (1 - one_hot) * eps / (n - 1)
    return -(one_hot * F.log_softmax(pred, 1)).sum(1).mean()


def main():
    args = cfg()
    rank, local_rank, world = setup_distributed()
    device = torch.device("cuda", local_rank)
    out = os.path.expandvars(args.out)

    train_ds = ModelNet40H5(args.data, "train", args.npoints)
    test_ds = ModelNet40H5(args.data, "test", args.npoints)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, drop_last=True,
                              pin_memory=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)), 64, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DGCNN(k=args.k)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 32, momentum=0.9,
                          weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs, eta_min=1e-3)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for pc, y in train_loader:
            pc, y = pc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = smooth_ce(model(pc), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()

        net = model.module.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for pc, y in test_loader:
                pc, y = pc.to(device), y.to(device)
                c += torch.tensor([(net(pc).argmax(1) == y).sum().item(), len(y)], device=device, dtype=torch.float)
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} test OA {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(out, exist_ok=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
