"""4x point cloud upsampling (PU-GCN-like: EdgeConv features + NodeShuffle expansion) on PU1K patches.

    torchrun --nproc_per_node=4 16_pu_upsampling.py --h5 data/PU1K/train/pu1K_poisson_256_poisson_1024_pc_2500_patch50_addpugan.h5
"""
import argparse
import logging
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger(__name__)


class PUPatches(Dataset):
    def __init__(self, h5_path, n_input=256, up_ratio=4, augment=True):
        with h5py.File(h5_path, "r") as f:
            self.inputs = f["poisson_256"][:].astype(np.float32)
            self.gts = f["poisson_1024"][:].astype(np.float32)
        # normalise each patch pair by the gt patch
        centroid = self.gts[..., :3].mean(1, keepdims=True)
        self.gts[..., :3] -= centroid
        self.inputs[..., :3] -= centroid
        radius = np.linalg.norm(self.gts[..., :3], axis=-1, keepdims=True).max(1, keepdims=True)
        self.gts[..., :3] /= radius
        self.inputs[..., :3] /= radius
        self.n_input, self.up_ratio, self.augment = n_input, up_ratio, augment

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        inp, gt = self.inputs[i, :, :3].copy(), self.gts[i, :, :3].copy()
        if self.augment:
            angles = np.random.uniform(0, 2 * np.pi, 3)
            Rx = np.array([[1, 0, 0], [0, np.cos(angles[0]), -np.sin(angles[0])], [0, np.sin(angles[0]), np.cos(angles[0])]])
            Ry = np.array([[np.cos(angles[1]), 0, np.sin(angles[1])], [0, 1, 0], [-np.sin(angles[1]), 0, np.cos(angles[1])]])
            Rz = np.array([[np.cos(angles[2]), -np.sin(angles[2]), 0], [np.sin(angles[2]), np.cos(angles[2]), 0], [0, 0, 1]])
            R = (Rz @ Ry @ Rx).astype(np.float32)
            inp, gt = inp @ R.T, gt @ R.T
            s = np.random.uniform(0.8, 1.2)
            inp, gt = inp * s, gt * s
            inp = inp + np.clip(0.01 * np.random.randn(*inp.shape), -0.03, 0.03).astype(np.float32)
        return torch.from_numpy(inp), torch.from_numpy(gt)


def knn(x, k):
    # x: B x C x N
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = (x ** 2).sum(1, keepdim=True)
    return (-xx - inner - xx.transpose(2, 1)).topk(k=k, dim=-1)[1]


def edge_features(x, k):
    B, C, N = x.shape
    idx = knn(x, k) + torch.arange(B, device=x.device).view(-1, 1, 1) * N
    xt = x.transpose(2, 1).contiguous()
    nb = xt.view(B * N, C)[idx.view(-1)].view(B, N, k, C)
    center = xt.unsqueeze(2).expand(-1, -1, k, -1)
    return torch.cat([nb - center, center], 3).permute(0, 3, 1, 2)


class EdgeConv(nn.Module):
    def __init__(self, cin, cout, k=20):
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv2d(2 * cin, cout, 1), nn.GroupNorm(4, cout), nn.LeakyReLU(0.2))

    def forward(self, x):
        return self.conv(edge_features(x, self.k)).max(-1)[0]


class PUNet(nn.Module):
    def __init__(self, up_ratio=4, k=20):
        super().__init__()
        self.up_ratio = up_ratio
        self.ec1, self.ec2, self.ec3 = EdgeConv(3, 64, k), EdgeConv(64, 64, k), EdgeConv(64, 128, k)
        self.fuse = nn.Sequential(nn.Conv1d(256, 256, 1), nn.LeakyReLU(0.2))
        self.shuffle = nn.Conv1d(256, 128 * up_ratio, 1)  # NodeShuffle
        self.head = nn.Sequential(nn.Conv1d(128, 64, 1), nn.LeakyReLU(0.2), nn.Conv1d(64, 3, 1))

    def forward(self, xyz):
        x = xyz.transpose(1, 2)
        f1 = self.ec1(x)
        f2 = self.ec2(f1)
        f3 = self.ec3(f2)
        f = self.fuse(torch.cat([f1, f2, f3], 1))
        B, _, N = f.shape
        f = self.shuffle(f).view(B, 128, self.up_ratio, N).permute(0, 1, 3, 2).reshape(B, 128, N * self.up_ratio)
        offset = self.head(f)
        base = x.repeat_interleave(self.up_ratio, dim=2)
        return (base + offset).transpose(1, 2)


def chamfer(p, q):
    d = torch.cdist(p, q).pow(2)
    return d.min(2)[0].mean(1) + d.min(1)[0].mean(1)


def repulsion(p, k=5, h=0.03):
    d = torch.cdist(p, p)
    knn_d = d.topk(k + 1, largest=False)[0][..., 1:]
    return (-knn_d.pow(2) * torch.exp(-knn_d.pow(2) / h ** 2)).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--out", default="ckpt/pu_gcn")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--w_rep", type=float, default=1.0)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    ds = PUPatches(args.h5)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        pin_memory=True, drop_last=True)
    logger.info("patches: %d, iters/epoch: %d, world size %d", len(ds), len(loader), world)

    model = DDP(PUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start, args.epochs):
        model.train()
        stats = torch.zeros(3, device=device)
        for inp, gt in loader:
            inp, gt = inp.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            pred = model(inp)
            l_cd = chamfer(pred, gt).mean()
            l_rep = repulsion(pred)
            loss = 100 * l_cd + args.w_rep * l_rep
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([l_cd.detach(), l_rep.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)
        logger.info("epoch %d  cd %.6f  rep %.6f  lr %.2e", epoch, (stats[0] / stats[2]).item(),
                    (stats[1] / stats[2]).item(), sched.get_last_lr()[0])
        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch + 1 == args.epochs):
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"model_{epoch + 1}.pth"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
