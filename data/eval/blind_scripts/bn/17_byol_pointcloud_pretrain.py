"""
BYOL-style self-supervised pre-training of a DGCNN encoder on ShapeNetCore-55
(pre-sampled 2048-point clouds), followed by a linear-SVM probe on ModelNet40.

  torchrun --nproc_per_node=8 pretrain_byol.py --shapenet data/ShapeNet55/shapenet_pc \
      --modelnet data/modelnet40_ply_hdf5_2048 --out runs/byol_dgcnn
"""
import argparse
import copy
import datetime
import glob
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.svm import LinearSVC
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--shapenet", required=True)
    p.add_argument("--modelnet", required=True)
    p.add_argument("--out", default="runs/byol_dgcnn")
    p.add_argument("--batch_size", type=int, default=32, help="per GPU, two views each")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--base_lr", type=float, default=1e-3, help="for a total batch of 256")
    p.add_argument("--tau", type=float, default=0.996)
    p.add_argument("--npoints", type=int, default=1024)
    p.add_argument("--k", type=int, default=20)
    return p.parse_args()


class ShapeNetTwoViews(Dataset):
    def __init__(self, root, npoints):
        self.files = sorted(glob.glob(os.path.join(root, "*.npy")))
        self.npoints = npoints

    def __len__(self):
        return len(self.files)

    def _view(self, pc):
        pc = pc[np.random.choice(len(pc), self.npoints, replace=False)]
        theta = np.random.uniform(0, 2 * np.pi)
        c, s = np.cos(theta), np.sin(theta)
        pc = pc @ np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], np.float32)
        pc = pc * np.random.uniform(0.8, 1.2, 3) + np.random.uniform(-0.1, 0.1, 3)
        pc = pc + np.clip(0.01 * np.random.randn(*pc.shape), -0.05, 0.05)
        return pc.astype(np.float32)

    def __getitem__(self, i):
        pc = np.load(self.files[i]).astype(np.float32)
        pc = (pc - pc.mean(0)) / np.linalg.norm(pc - pc.mean(0), axis=1).max()
        return torch.from_numpy(self._view(pc)), torch.from_numpy(self._view(pc))


class ModelNetH5(Dataset):
    def __init__(self, root, split, npoints):
        d, l = [], []
        for f in sorted(glob.glob(os.path.join(root, f"ply_data_{split}*.h5"))):
            with h5py.File(f, "r") as h:
                d.append(h["data"][:, :npoints].astype(np.float32))
                l.append(h["label"][:].reshape(-1).astype(np.int64))
        self.data, self.label = np.concatenate(d), np.concatenate(l)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return torch.from_numpy(self.data[i]), self.label[i]


def graph_feature(x, k):
    b, c, n = x.shape
    idx = (-torch.cdist(x.transpose(1, 2), x.transpose(1, 2))).topk(k, -1)[1]
    idx = idx + torch.arange(b, device=x.device).view(-1, 1, 1) * n
    xt = x.transpose(1, 2).reshape(b * n, c)
    nb = xt[idx.view(-1)].view(b, n, k, c)
    ctr = x.transpose(1, 2).unsqueeze(2).expand(-1, -1, k, -1)
    return torch.cat([nb - ctr, ctr], 3).permute(0, 3, 1, 2)


class DGCNNEncoder(nn.Module):
    def __init__(self, k=20, emb=1024):
        super().__init__()
        self.k = k
        blk = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 1, bias=False), nn.BatchNorm2d(o), nn.LeakyReLU(0.2))
        self.e1, self.e2, self.e3, self.e4 = blk(6, 64), blk(128, 64), blk(128, 128), blk(256, 256)
        self.out = nn.Sequential(nn.Conv1d(512, emb, 1, bias=False), nn.BatchNorm1d(emb), nn.LeakyReLU(0.2))

    def forward(self, x):
        x1 = self.e1(graph_feature(x, self.k)).max(-1)[0]
        x2 = self.e2(graph_feature(x1, self.k)).max(-1)[0]
        x3 = self.e3(graph_feature(x2, self.k)).max(-1)[0]
        x4 = self.e4(graph_feature(x3, self.k)).max(-1)[0]
        x = self.out(torch.cat([x1, x2, x3, x4], 1))
        return torch.cat([x.max(-1)[0], x.mean(-1)], 1)


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.BatchNorm1d(h), nn.ReLU(inplace=True), nn.Linear(h, o))


class BYOLOnline(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.encoder = DGCNNEncoder(k)
        self.projector = mlp(2048, 4096, 256)
        self.predictor = mlp(256, 4096, 256)

    def forward(self, x):
        z = self.projector(self.encoder(x))
        return self.predictor(z)


def byol_loss(p, z):
    return 2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1).mean()


@torch.no_grad()
def extract(encoder, loader, device):
    encoder.eval()
    feats, labels = [], []
    for pc, y in loader:
        feats.append(encoder(pc.to(device).transpose(1, 2)).cpu())
        labels.append(y)
    encoder.train()
    return torch.cat(feats).numpy(), torch.cat(labels).numpy()


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the SVM probe runs on rank 0 only and can take several minutes
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds = ShapeNetTwoViews(args.shapenet, args.npoints)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    online = nn.SyncBatchNorm.convert_sync_batchnorm(BYOLOnline(args.k)).to(device)
    # target network: same weights at start, never gets gradients, updated by EMA on every rank
    target = copy.deepcopy(nn.Sequential(online.encoder, online.projector))
    for p in target.parameters():
        p.requires_grad_(False)
    online = DDP(online, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(online.parameters(), lr=lr, weight_decay=1e-6)
    total_steps = args.epochs * len(loader)
    warmup = 10 * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total_steps - warmup))))

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        online.train()
        t0 = time.time()
        for v1, v2 in loader:
            b = v1.shape[0]
            x = torch.cat([v1, v2]).to(device, non_blocking=True).transpose(1, 2)
            # one forward for both views: BN sees both, and DDP does a single pass per step
            p = online(x)
            with torch.no_grad():
                z = target(x)
            loss = byol_loss(p[:b], z[b:]) + byol_loss(p[b:], z[:b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            tau = 1 - (1 - args.tau) * (math.cos(math.pi * step / total_steps) + 1) / 2
            with torch.no_grad():
                src = list(online.module.encoder.parameters()) + list(online.module.projector.parameters())
                for pt, po in zip(target.parameters(), src):
                    pt.mul_(tau).add_(po.detach(), alpha=1 - tau)
                src_b = list(online.module.encoder.buffers()) + list(online.module.projector.buffers())
                for bt, bo in zip(target.buffers(), src_b):
                    bt.copy_(bo)

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("pretrain/loss", l.item(), step)
                    writer.add_scalar("pretrain/tau", tau, step)
                    print(f"ep {epoch} step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"({time.time() - t0:.0f}s)", flush=True)

        if rank == 0:
            torch.save({"epoch": epoch, "online": online.module.state_dict(), "target": target.state_dict(),
                        "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step},
                       os.path.join(args.out, "last.pth"))
            if (epoch + 1) % 20 == 0:
                tr = DataLoader(ModelNetH5(args.modelnet, "train", args.npoints), batch_size=64, num_workers=4)
                te = DataLoader(ModelNetH5(args.modelnet, "test", args.npoints), batch_size=64, num_workers=4)
                enc = online.module.encoder
                ftr, ytr = extract(enc, tr, device)
                fte, yte = extract(enc, te, device)
                svm = LinearSVC(C=0.01, max_iter=5000).fit(ftr, ytr)
                acc = (svm.predict(fte) == yte).mean()
                print(f"epoch {epoch} linear SVM ModelNet40 acc {acc:.4f}", flush=True)
                writer.add_scalar("probe/svm_acc", acc, epoch)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
