"""
DGCNN classification on ModelNet40 (2048-point HDF5 release), single node,
one process per GPU started with torch.multiprocessing.spawn.

    python 11_dgcnn_modelnet_spawn.py --data data/modelnet40_ply_hdf5_2048 --gpus 4 --accum 2

Per-class accuracy is computed over the exact test set: each rank evaluates an
unpadded shard, predictions are padded to a common length for all_gather and
trimmed again on rank 0.
"""
import argparse
import glob
import os
from contextlib import nullcontext

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class ModelNet40H5(Dataset):
    def __init__(self, root, split, num_points=1024, augment=False):
        pts, lbl = [], []
        for f in sorted(glob.glob(os.path.join(root, f"ply_data_{split}*.h5"))):
            with h5py.File(f, "r") as h:
                pts.append(h["data"][:].astype(np.float32))
                lbl.append(h["label"][:].astype(np.int64).reshape(-1))
        self.points, self.labels = np.concatenate(pts), np.concatenate(lbl)
        self.num_points, self.augment = num_points, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        p = self.points[i, : self.num_points].copy()
        if self.augment:
            p = p * np.random.uniform(2 / 3, 3 / 2, 3) + np.random.uniform(-0.2, 0.2, 3)
            np.random.shuffle(p)
        return torch.from_numpy(p.astype(np.float32)), self.labels[i], i


def knn_features(x, k):
    # x: B, C, N  ->  B, 2C, N, k
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    sq = (x ** 2).sum(1, keepdim=True)
    idx = (-sq - inner - sq.transpose(2, 1)).topk(k, dim=-1)[1]             # B, N, k
    B, C, N = x.shape
    base = torch.arange(B, device=x.device).view(-1, 1, 1) * N
    nbr = x.transpose(2, 1).reshape(B * N, C)[(idx + base).view(-1)].view(B, N, k, C)
    ctr = x.transpose(2, 1).unsqueeze(2).expand(-1, -1, k, -1)
    return torch.cat([nbr - ctr, ctr], dim=3).permute(0, 3, 1, 2).contiguous()


class DGCNN(nn.Module):
    def __init__(self, k=20, emb=1024, classes=40):
        super().__init__()
        self.k = k
        def edge(ci, co):
            return nn.Sequential(nn.Conv2d(2 * ci, co, 1, bias=False), nn.BatchNorm2d(co), nn.LeakyReLU(0.2))
        self.e1, self.e2, self.e3, self.e4 = edge(3, 64), edge(64, 64), edge(64, 128), edge(128, 256)
        self.fuse = nn.Sequential(nn.Conv1d(512, emb, 1, bias=False), nn.BatchNorm1d(emb), nn.LeakyReLU(0.2))
        self.head = nn.Sequential(nn.Linear(2 * emb, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2),
                                  nn.Dropout(0.5), nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2),
                                  nn.Dropout(0.5), nn.Linear(256, classes))

    def forward(self, pts):
        x = pts.transpose(1, 2)
        feats = []
        for e in (self.e1, self.e2, self.e3, self.e4):
            x = e(knn_features(x, self.k)).max(dim=-1)[0]
            feats.append(x)
        x = self.fuse(torch.cat(feats, dim=1))
        return self.head(torch.cat([x.max(-1)[0], x.mean(-1)], dim=1))


@torch.no_grad()
def evaluate(net, test_set, rank, world, device):
    """net is the bare module: no DDP forward, so uneven shard sizes are fine."""
    net.eval()
    shard = Subset(test_set, list(range(rank, len(test_set), world)))
    preds, idxs = [], []
    for pts, _, i in DataLoader(shard, batch_size=64, num_workers=4):
        preds.append(net(pts.to(device)).argmax(-1))
        idxs.append(i.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(idxs)])                 # 2, n_local
    n_local = torch.tensor([local.shape[1]], device=device)
    sizes = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(sizes, n_local)
    max_n = int(max(s.item() for s in sizes))
    padded = F.pad(local, (0, max_n - local.shape[1]), value=-1)
    buckets = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(buckets, padded)
    if rank != 0:
        return None
    allp = torch.cat([b[:, : s.item()] for b, s in zip(buckets, sizes)], dim=1).cpu()
    labels = torch.as_tensor(test_set.labels)[allp[1]]
    correct = (allp[0] == labels).float()
    per_class = torch.zeros(40).index_add_(0, labels, correct) / torch.bincount(labels, minlength=40).clamp(min=1)
    return correct.mean().item(), per_class.mean().item()


def train_worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)
    try:
        train_set = ModelNet40H5(cfg.data, "train", augment=True)
        test_set = ModelNet40H5(cfg.data, "test")
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
        loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True, persistent_workers=True)

        model = nn.SyncBatchNorm.convert_sync_batchnorm(DGCNN()).to(device)
        model = DDP(model, device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr * cfg.batch_size * world_size * cfg.accum / 32,
                              momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs, eta_min=1e-3)
        ckpt_path = os.path.join(cfg.out, "dgcnn_last.pt")
        start = 0
        if os.path.exists(ckpt_path):
            st = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
            model.module.load_state_dict(st["model"]); opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"]); start = st["epoch"] + 1

        for epoch in range(start, cfg.epochs):
            sampler.set_epoch(epoch)
            model.train()
            loss_acc = torch.zeros(2, device=device)
            opt.zero_grad(set_to_none=True)
            for it, (pts, y, _) in enumerate(loader):
                pts, y = pts.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync_now = (it + 1) % cfg.accum == 0
                ctx = nullcontext() if sync_now else model.no_sync()
                with ctx:
                    loss = F.cross_entropy(model(pts), y, label_smoothing=0.2) / cfg.accum
                    loss.backward()
                if sync_now:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                loss_acc += torch.stack([loss.detach() * cfg.accum, torch.ones((), device=device)])
            sched.step()
            dist.all_reduce(loss_acc)

            res = evaluate(model.module, test_set, rank, world_size, device)
            if rank == 0:
                oa, macc = res
                print(f"epoch {epoch:3d} loss {(loss_acc[0] / loss_acc[1]).item():.4f} OA {oa:.4f} mAcc {macc:.4f}",
                      flush=True)
                os.makedirs(cfg.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

        summary = {"rank": rank, "host": os.uname().nodename,
                   "peak_mem_gb": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2),
                   "samples_seen": len(sampler) * (cfg.epochs - start)}
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, summary)
        if rank == 0:
            print("finished:", per_rank, flush=True)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/dgcnn")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=23456)
    cfg = ap.parse_args()
    mp.spawn(train_worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
