"""
PCT (Point Cloud Transformer, offset-attention) for ModelNet40 classification.

Launch:
    torchrun --nproc_per_node=4 train_pct.py --data_root data/modelnet40_ply_hdf5_2048 --exp pct_cls
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
from torch.utils.tensorboard import SummaryWriter

from pointnet2_ops import pointnet2_utils


def get_args():
    parser = argparse.ArgumentParser("PCT")
    parser.add_argument("--data_root", default="data/modelnet40_ply_hdf5_2048")
    parser.add_argument("--exp", default="pct_cls")
    parser.add_argument("--batch_size", type=int, default=32, help="per GPU")
    parser.add_argument("--test_batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--num_points", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args()


class ModelNet40(Dataset):
    def __init__(self, root, split, num_points):
        data, label = [], []
        for h5_name in sorted(glob.glob(os.path.join(root, f"ply_data_{split}*.h5"))):
            with h5py.File(h5_name, "r") as f:
                data.append(f["data"][:].astype("float32"))
                label.append(f["label"][:].astype("int64"))
        self.data, self.label = np.concatenate(data), np.concatenate(label).reshape(-1)
        self.num_points, self.train = num_points, split == "train"

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        pc = self.data[i][: self.num_points]
        if self.train:
            pc = pc * np.random.uniform(2.0 / 3.0, 1.5, size=3) + np.random.uniform(-0.2, 0.2, size=3)
            pc = pc[np.random.permutation(self.num_points)]
        return torch.from_numpy(pc.astype("float32")), self.label[i]


def sample_and_group(npoint, nsample, xyz, points):
    # xyz: B,N,3  points: B,N,C
    fps_idx = pointnet2_utils.furthest_point_sample(xyz.contiguous(), npoint).long()
    bidx = torch.arange(xyz.shape[0], device=xyz.device).view(-1, 1)
    new_xyz, new_points = xyz[bidx, fps_idx], points[bidx, fps_idx]
    idx = torch.cdist(new_xyz, xyz).topk(nsample, dim=-1, largest=False)[1]
    grouped = points[bidx.unsqueeze(-1), idx]                           # B,S,k,C
    grouped = torch.cat([grouped - new_points.unsqueeze(2),
                         new_points.unsqueeze(2).expand(-1, -1, nsample, -1)], -1)
    return new_xyz, grouped


class LocalOp(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout), nn.ReLU(),
                                 nn.Conv1d(cout, cout, 1, bias=False), nn.BatchNorm1d(cout), nn.ReLU())

    def forward(self, x):                                               # B,S,k,C
        b, s, k, c = x.shape
        x = self.net(x.permute(0, 1, 3, 2).reshape(b * s, c, k))
        return x.max(-1)[0].view(b, s, -1).permute(0, 2, 1)             # B,C',S


class OffsetAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q = nn.Conv1d(c, c // 4, 1, bias=False)
        self.k = nn.Conv1d(c, c // 4, 1, bias=False)
        self.q.weight = self.k.weight
        self.v = nn.Conv1d(c, c, 1)
        self.trans = nn.Conv1d(c, c, 1)
        self.bn = nn.BatchNorm1d(c)

    def forward(self, x):
        energy = torch.bmm(self.q(x).permute(0, 2, 1), self.k(x))
        attn = F.softmax(energy, dim=-1)
        attn = attn / (1e-9 + attn.sum(dim=1, keepdim=True))
        xr = torch.bmm(self.v(x), attn)
        return x + F.relu(self.bn(self.trans(x - xr)))


class PCT(nn.Module):
    def __init__(self, num_classes=40):
        super().__init__()
        self.embed = nn.Sequential(nn.Conv1d(3, 64, 1, bias=False), nn.BatchNorm1d(64), nn.ReLU(),
                                   nn.Conv1d(64, 64, 1, bias=False), nn.BatchNorm1d(64), nn.ReLU())
        self.g0, self.g1 = LocalOp(128, 128), LocalOp(256, 256)
        self.pre = nn.Sequential(nn.Conv1d(256, 256, 1, bias=False), nn.BatchNorm1d(256), nn.ReLU())
        self.sa = nn.ModuleList([OffsetAttention(256) for _ in range(4)])
        self.fuse = nn.Sequential(nn.Conv1d(1280, 1024, 1, bias=False), nn.BatchNorm1d(1024), nn.LeakyReLU(0.2))
        self.head = nn.Sequential(nn.Linear(1024, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2),
                                  nn.Dropout(0.5), nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2),
                                  nn.Dropout(0.5), nn.Linear(256, num_classes))

    def forward(self, xyz):
        x = self.embed(xyz.transpose(1, 2)).transpose(1, 2)
        xyz, g = sample_and_group(512, 32, xyz, x)
        x = self.g0(g).transpose(1, 2)
        xyz, g = sample_and_group(256, 32, xyz, x)
        x = self.pre(self.g1(g))
        feat = x
        outs = []
        for layer in self.sa:
            x = layer(x)
            outs.append(x)
        x = self.fuse(torch.cat(outs + [feat], 1))
        return self.head(x.max(-1)[0])


def smooth_loss(pred, gold, eps=0.2):
    n = pred.size(1)
    one_hot = F.one_hot(gold, n).float() * (1 - eps) + eps / n
    return -(one_hot * F.log_softmax(pred, 1)).sum(1).mean()


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    counts = torch.zeros(2, 40, device=device)
    for pc, y in loader:
        pc, y = pc.to(device), y.to(device)
        pred = model(pc).argmax(1)
        counts[0].index_add_(0, y, (pred == y).float())
        counts[1].index_add_(0, y, torch.ones_like(y, dtype=torch.float))
    dist.all_reduce(counts)
    return (counts[0].sum() / counts[1].sum()).item(), (counts[0] / counts[1].clamp(min=1)).mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    exp_dir = os.path.join("checkpoints", args.exp)
    writer = None
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
        writer = SummaryWriter(exp_dir)

    train_set = ModelNet40(args.data_root, "train", args.num_points)
    test_set = ModelNet40(args.data_root, "test", args.num_points)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.test_batch_size, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PCT()).to(device)
    model = DDP(model, device_ids=[local_rank])
    # lr of the reference implementation is for a batch of 32 on one GPU
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 32,
                          momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs, eta_min=args.lr / 100)

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for pc, y in train_loader:
            pc, y = pc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(pc)
            loss = smooth_loss(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            meter += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
        sched.step()
        dist.all_reduce(meter)
        acc, mean_cls_acc = test(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} | loss {meter[0].item() / meter[2].item():.4f} | "
                  f"train acc {meter[1].item() / meter[2].item():.4f} | test acc {acc:.4f} | "
                  f"mAcc {mean_cls_acc:.4f} | {time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("loss/train", meter[0].item() / meter[2].item(), epoch)
            writer.add_scalar("acc/test", acc, epoch)
            if acc >= best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(exp_dir, "model.t7"))
        dist.barrier()

    if rank == 0:
        print(f"best test acc {best_acc:.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
