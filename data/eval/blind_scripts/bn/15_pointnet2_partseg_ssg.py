"""
PointNet++ (SSG) part segmentation on ShapeNetPart with normals.
Trains with DDP, keeps the best checkpoint by instance mIoU, then runs a final
vote-free test pass with the best weights on rank 0.

    torchrun --nproc_per_node=4 train_partseg.py --root data/shapenetcore_partanno_segmentation_benchmark_v0_normal
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pointnet2_ops.pointnet2_modules import PointnetFPModule, PointnetSAModule

NUM_PARTS, NUM_CATS = 50, 16
PART_RANGES = [(0, 4), (4, 6), (6, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 24), (24, 28), (28, 30),
               (30, 36), (36, 38), (38, 41), (41, 44), (44, 47), (47, 50)]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--npoint", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decay_step", type=int, default=20)
    p.add_argument("--out", default="log/part_seg/pointnet2_ssg")
    return p.parse_args()


class PartNormalDataset(Dataset):
    def __init__(self, root, split, npoint):
        cats = sorted(l.split()[0] for l in open(os.path.join(root, "synsetoffset2category.txt")))
        offsets = {l.split()[0]: l.split()[1] for l in open(os.path.join(root, "synsetoffset2category.txt"))}
        syn2idx = {offsets[c]: i for i, c in enumerate(cats)}
        ids = json.load(open(os.path.join(root, "train_test_split", f"shuffled_{split}_file_list.json")))
        self.items = [(syn2idx[s.split("/")[1]], os.path.join(root, s.split("/")[1], s.split("/")[2] + ".txt"))
                      for s in ids]
        self.npoint, self.train = npoint, split != "test"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        cls, fn = self.items[i]
        d = np.loadtxt(fn).astype(np.float32)
        pts, seg = d[:, :6], d[:, -1].astype(np.int64)
        pts[:, :3] -= pts[:, :3].mean(0)
        pts[:, :3] /= np.linalg.norm(pts[:, :3], axis=1).max()
        choice = np.random.choice(len(seg), self.npoint, replace=True)
        pts, seg = pts[choice], seg[choice]
        if self.train:
            pts[:, :3] = pts[:, :3] * np.random.uniform(0.8, 1.25) + np.random.uniform(-0.1, 0.1, 3)
        return torch.from_numpy(pts), cls, torch.from_numpy(seg)


class PointNet2PartSeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = PointnetSAModule(npoint=512, radius=0.2, nsample=32, mlp=[3, 64, 64, 128])
        self.sa2 = PointnetSAModule(npoint=128, radius=0.4, nsample=64, mlp=[128, 128, 128, 256])
        self.sa3 = PointnetSAModule(mlp=[256, 256, 512, 1024])
        self.fp3 = PointnetFPModule(mlp=[1280, 256, 256])
        self.fp2 = PointnetFPModule(mlp=[384, 256, 128])
        self.fp1 = PointnetFPModule(mlp=[128 + 6 + NUM_CATS, 128, 128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU(True),
                                  nn.Dropout(0.5), nn.Conv1d(128, NUM_PARTS, 1))

    def forward(self, pts, cls):
        xyz = pts[..., :3].contiguous()
        feats = pts.transpose(1, 2).contiguous()
        l1_xyz, l1 = self.sa1(xyz, feats[:, 3:].contiguous())
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        l3_xyz, l3 = self.sa3(l2_xyz, l2)
        l2 = self.fp3(l2_xyz, l3_xyz, l2, l3)
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        onehot = F.one_hot(cls, NUM_CATS).float().unsqueeze(-1).expand(-1, -1, xyz.shape[1])
        l0 = self.fp1(xyz, l1_xyz, torch.cat([onehot, feats], 1), l1)
        return self.head(l0)


@torch.no_grad()
def run_test(model, loader, device):
    """Returns summed (instance IoU, count, correct points, points) for this process's shapes."""
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for pts, cls, seg in loader:
        pts, cls, seg = pts.to(device), cls.to(device), seg.to(device)
        logits = model(pts, cls)
        for b in range(pts.shape[0]):
            lo, hi = PART_RANGES[cls[b].item()]
            pred = logits[b, lo:hi].argmax(0) + lo
            ious = []
            for p in range(lo, hi):
                i = ((pred == p) & (seg[b] == p)).sum()
                u = ((pred == p) | (seg[b] == p)).sum()
                ious.append(1.0 if u == 0 else (i.float() / u.float()).item())
            acc += torch.tensor([np.mean(ious), 1.0, (pred == seg[b]).sum().item(), seg[b].numel()],
                                device=device, dtype=torch.float64)
    return acc


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set = PartNormalDataset(args.root, "trainval", args.npoint)
    test_set = PartNormalDataset(args.root, "test", args.npoint)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              drop_last=True, pin_memory=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=24, num_workers=6)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2PartSeg()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay_step, gamma=0.5)
    best_path = os.path.join(args.out, "best_model.pth")

    best_miou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        # BN momentum decay as in the original implementation
        momentum = max(0.1 * 0.5 ** (epoch // args.decay_step), 0.01)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = momentum
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for pts, cls, seg in train_loader:
            pts, cls, seg = pts.to(device, non_blocking=True), cls.to(device), seg.to(device, non_blocking=True)
            logits = model(pts, cls)
            loss = F.cross_entropy(logits, seg)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(total)

        res = run_test(model.module, test_loader, device)
        dist.all_reduce(res)
        ins_miou, acc = (res[0] / res[1]).item(), (res[2] / res[3]).item()
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f} acc {acc:.4f} "
                  f"ins mIoU {ins_miou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ins_miou > best_miou:
                best_miou = ins_miou
                torch.save({"epoch": epoch, "model_state_dict": model.state_dict(), "ins_miou": ins_miou},
                           best_path)
        dist.barrier()

    # final evaluation of the best weights, single process
    if rank == 0:
        ckpt = torch.load(best_path, map_location=device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2PartSeg()).to(device)
        net.load_state_dict(ckpt["model_state_dict"])
        full_loader = DataLoader(test_set, batch_size=24, num_workers=6)
        res = run_test(net, full_loader, device)
        print(f"best epoch {ckpt['epoch']}: instance mIoU {(res[0] / res[1]).item():.4f} "
              f"acc {(res[2] / res[3]).item():.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
