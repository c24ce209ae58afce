#!/usr/bin/env python3
"""Occupancy network training on ShapeNet (ONet data layout: points.npz / pointcloud.npz).

    torchrun --nproc_per_node=4 01_occnet_shapenet.py --data_root data/ShapeNet --out runs/onet_pc
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CATEGORIES = ["02691156", "02828884", "02933112", "02958343", "03001627", "03211117",
              "03636649", "03691459", "04090263", "04256520", "04379243", "04401088",
              "04530566"]


class ShapeNetOcc(Dataset):
    def __init__(self, root, split, n_points=3000, n_query=2048, noise=0.005):
        self.root = root
        self.n_points = n_points
        self.n_query = n_query
        self.noise = noise
        self.models = []
        for c in CATEGORIES:
            lst = os.path.join(root, c, f"{split}.lst")
            if not os.path.exists(lst):
                continue
            with open(lst) as f:
                self.models += [(c, l.strip()) for l in f if l.strip()]

    def __len__(self):
        return len(self.models)

    def __getitem__(self, idx):
        c, m = self.models[idx]
        folder = os.path.join(self.root, c, m)
        pc = np.load(os.path.join(folder, "pointcloud.npz"))["points"].astype(np.float32)
        pts = np.load(os.path.join(folder, "points.npz"))
        qp = pts["points"].astype(np.float32)
        occ = np.unpackbits(pts["occupancies"])[: qp.shape[0]].astype(np.float32)

        i = np.random.randint(pc.shape[0], size=self.n_points)
        inp = pc[i] + self.noise * np.random.randn(self.n_points, 3).astype(np.float32)
        j = np.random.randint(qp.shape[0], size=self.n_query)
        return {"inputs": torch.from_numpy(inp),
                "points": torch.from_numpy(qp[j]),
                "occ": torch.from_numpy(occ[j])}


def worker_init_fn(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed + worker_id)


class ResnetBlockFC(nn.Module):
    def __init__(self, size_in, size_out=None, size_h=None):
        super().__init__()
        size_out = size_out or size_in
        size_h = size_h or min(size_in, size_out)
        self.fc_0 = nn.Linear(size_in, size_h)
        self.fc_1 = nn.Linear(size_h, size_out)
        self.shortcut = None if size_in == size_out else nn.Linear(size_in, size_out, bias=False)
        nn.init.zeros_(self.fc_1.weight)

    def forward(self, x):
        net = self.fc_0(F.relu(x))
        dx = self.fc_1(F.relu(net))
        x_s = x if self.shortcut is None else self.shortcut(x)
        return x_s + dx


class ResnetPointnet(nn.Module):
    def __init__(self, c_dim=256, hidden=256):
        super().__init__()
        self.fc_pos = nn.Linear(3, 2 * hidden)
        self.blocks = nn.ModuleList([ResnetBlockFC(2 * hidden, hidden) for _ in range(5)])
        self.fc_c = nn.Linear(hidden, c_dim)

    def forward(self, p):
        net = self.blocks[0](self.fc_pos(p))
        for blk in self.blocks[1:]:
            pooled = net.max(dim=1, keepdim=True)[0].expand_as(net)
            net = blk(torch.cat([net, pooled], dim=2))
        return self.fc_c(F.relu(net.max(dim=1)[0]))


class OccDecoder(nn.Module):
    def __init__(self, c_dim=256, hidden=256, n_blocks=5):
        super().__init__()
        self.fc_p = nn.Linear(3, hidden)
        self.fc_c = nn.ModuleList([nn.Linear(c_dim, hidden) for _ in range(n_blocks)])
        self.blocks = nn.ModuleList([ResnetBlockFC(hidden) for _ in range(n_blocks)])
        self.fc_out = nn.Linear(hidden, 1)

    def forward(self, p, c):
        net = self.fc_p(p)
        for fc_c, blk in zip(self.fc_c, self.blocks):
            net = blk(net + fc_c(c).unsqueeze(1))
        return self.fc_out(F.relu(net)).squeeze(-1)


class OccupancyNetwork(nn.Module):
    def __init__(self, c_dim=256):
        super().__init__()
        self.encoder = ResnetPointnet(c_dim)
        self.decoder = OccDecoder(c_dim)

    def forward(self, points, inputs):
        return self.decoder(points, self.encoder(inputs))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/ShapeNet")
    p.add_argument("--out", default="runs/onet_pc")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--c_dim", type=int, default=256)
    p.add_argument("--n_points", type=int, default=3000)
    p.add_argument("--n_query", type=int, default=2048)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--val_every", type=int, default=5)
    p.add_argument("--val_shapes", type=int, default=512)
    p.add_argument("--pretrained_encoder", default="")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, threshold=0.5):
    model.eval()
    ious, losses = [], []
    for batch in loader:
        inputs = batch["inputs"].to(device, non_blocking=True)
        points = batch["points"].to(device, non_blocking=True)
        occ = batch["occ"].to(device, non_blocking=True)
        logits = model(points, inputs)
        losses.append(F.binary_cross_entropy_with_logits(logits, occ).item())
        pred = torch.sigmoid(logits) >= threshold
        gt = occ >= 0.5
        inter = (pred & gt).sum(-1).float()
        union = (pred | gt).sum(-1).float().clamp(min=1)
        ious.append((inter / union).cpu())
    model.train()
    return float(np.mean(losses)), torch.cat(ious).mean().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    train_set = ShapeNetOcc(args.data_root, "train", args.n_points, args.n_query)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              worker_init_fn=worker_init_fn, persistent_workers=True)

    writer = None
    val_loader = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        val_set = ShapeNetOcc(args.data_root, "val", args.n_points, args.n_query)
        g = np.random.RandomState(1234)
        keep = g.choice(len(val_set), min(args.val_shapes, len(val_set)), replace=False)
        val_loader = DataLoader(Subset(val_set, keep.tolist()), batch_size=32,
                                num_workers=4, worker_init_fn=worker_init_fn)

    model = OccupancyNetwork(args.c_dim)
    if args.pretrained_encoder:
        enc_state = torch.load(args.pretrained_encoder, map_location="cpu")
        model.encoder.load_state_dict(enc_state)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch, it, best_iou = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, it, best_iou = ckpt["epoch"] + 1, ckpt["it"], ckpt.get("best_iou", 0.0)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            inputs = batch["inputs"].to(device, non_blocking=True)
            points = batch["points"].to(device, non_blocking=True)
            occ = batch["occ"].to(device, non_blocking=True)

            logits = model(points, inputs)
            loss = F.binary_cross_entropy_with_logits(logits, occ, reduction="none").sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                print(f"[ep {epoch} it {it}] loss {loss.item():.4f} "
                      f"({(time.time() - t0) / 50:.3f}s/it)", flush=True)
                t0 = time.time()

        if (epoch + 1) % args.val_every == 0:
            if rank == 0:
                val_loss, val_iou = evaluate(model.module, val_loader, device)
                writer.add_scalar("val/loss", val_loss, it)
                writer.add_scalar("val/iou", val_iou, it)
                print(f"epoch {epoch}: val loss {val_loss:.4f} iou {val_iou:.4f}", flush=True)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "it": it, "best_iou": max(best_iou, val_iou)}
                torch.save(state, os.path.join(args.out, "model.pt"))
                if val_iou > best_iou:
                    best_iou = val_iou
                    torch.save(state, os.path.join(args.out, "model_best.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
