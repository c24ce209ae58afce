"""VectorNet (polyline subgraphs + global interaction graph) with the node-completion auxiliary task.

Focal-agent forecasting on Waymo scenes exported to VectorNet vectors.

    torchrun --nproc_per_node=4 12_vectornet_torchrun.py --data-dir /data/womd_vectornet \
        --output-dir checkpoints/vectornet_womd
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("vectornet")

MAX_POLYLINES = 160
MAX_VECTORS = 19
VEC_DIM = 8  # x_s, y_s, x_e, y_e, attr (type/timestamp), polyline id ...
FUT = 30  # 3 s @ 10 Hz


def parse_args():
    parser = argparse.ArgumentParser(description="VectorNet training")
    parser.add_argument("--data-dir", type=str, required=True)
    parser.add_argument("--output-dir", type=str, default="checkpoints/vectornet")
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay-every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--global-dim", type=int, default=64)
    parser.add_argument("--aux-weight", type=float, default=1.0)
    parser.add_argument("--mask-ratio", type=float, default=0.15)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class VectorizedScenes(Dataset):
    def __init__(self, path):
        with open(path, "rb") as f:
            self.samples = pickle.load(f)  # list of dicts written by the converter

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        s = self.samples[idx]
        vec = np.zeros((MAX_POLYLINES, MAX_VECTORS, VEC_DIM), np.float32)
        vmask = np.zeros((MAX_POLYLINES, MAX_VECTORS), np.bool_)
        for p, poly in enumerate(s["polylines"][:MAX_POLYLINES]):
            n = min(len(poly), MAX_VECTORS)
            vec[p, :n] = poly[:n]
            vmask[p, :n] = True
        return {
            "vectors": torch.from_numpy(vec),
            "vec_mask": torch.from_numpy(vmask),
            "poly_mask": torch.from_numpy(vmask.any(-1)),
            "gt": torch.from_numpy(s["future"][:FUT].astype(np.float32)),  # focal agent is polyline 0
        }


class SubGraph(nn.Module):
    def __init__(self, in_dim, hidden, layers=3):
        super().__init__()
        self.layers = nn.ModuleList()
        dim = in_dim
        for _ in range(layers):
            self.layers.append(nn.Sequential(nn.Linear(dim, hidden), nn.LayerNorm(hidden), nn.ReLU()))
            dim = 2 * hidden

    def forward(self, x, mask):  # [B, P, V, C]
        for layer in self.layers:
            x = layer(x)
            agg = x.masked_fill(~mask[..., None], -1e4).max(2, keepdim=True).values
            x = torch.cat([x, agg.expand_as(x)], -1)
        return x.masked_fill(~mask[..., None], -1e4).max(2).values  # [B, P, 2*hidden]


class GlobalGraph(nn.Module):
    def __init__(self, in_dim, dim):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(in_dim, dim), nn.Linear(in_dim, dim), nn.Linear(in_dim, dim)
        self.scale = dim ** -0.5

    def forward(self, x, mask):
        att = (self.q(x) @ self.k(x).transpose(1, 2)) * self.scale
        att = att.masked_fill(~mask[:, None], -1e4).softmax(-1)
        return att @ self.v(x)


class VectorNet(nn.Module):
    def __init__(self, hidden=64, global_dim=64):
        super().__init__()
        self.subgraph = SubGraph(VEC_DIM, hidden)
        self.global_graph = GlobalGraph(2 * hidden + 2, global_dim)
        self.traj_decoder = nn.Sequential(nn.Linear(global_dim, 64), nn.ReLU(), nn.Linear(64, FUT * 2))
        self.node_decoder = nn.Sequential(nn.Linear(global_dim, 64), nn.ReLU(), nn.Linear(64, 2 * hidden))

    def forward(self, vectors, vec_mask, poly_mask, node_drop=None):
        nodes = self.subgraph(vectors, vec_mask)
        target = nodes.detach()
        # polyline id embedding: min x/y of the polyline's start points
        start = vectors[..., :2].masked_fill(~vec_mask[..., None], 1e4).min(2).values
        start = start.masked_fill(~poly_mask[..., None], 0.0)
        if node_drop is not None:
            nodes = nodes.masked_fill(node_drop[..., None], 0.0)
        feats = F.normalize(torch.cat([nodes, start], -1), dim=-1)
        g = self.global_graph(feats, poly_mask)
        traj = self.traj_decoder(g[:, 0]).view(-1, FUT, 2)
        recon = self.node_decoder(g)
        return traj, recon, target


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] %(message)s")

    train_set = VectorizedScenes(os.path.join(args.data_dir, "train_vectors.pkl"))
    val_set = VectorizedScenes(os.path.join(args.data_dir, "val_vectors.pkl"))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = VectorNet(args.hidden, args.global_dim).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_decay_every, gamma=0.3)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_ade = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            # node completion: hide a random subset of non-focal polylines
            drop = (torch.rand_like(batch["poly_mask"], dtype=torch.float) < args.mask_ratio) & batch["poly_mask"]
            drop[:, 0] = False
            traj, recon, target = model(batch["vectors"], batch["vec_mask"], batch["poly_mask"], drop)
            traj_loss = F.smooth_l1_loss(traj, batch["gt"])
            aux = F.smooth_l1_loss(recon[drop], target[drop]) if drop.any() else recon.sum() * 0.0
            loss = traj_loss + args.aux_weight * aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter += torch.stack([traj_loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_meter)

        model.eval()
        ev = torch.zeros(3, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                traj, _, _ = model(batch["vectors"], batch["vec_mask"], batch["poly_mask"])
                err = (traj - batch["gt"]).norm(dim=-1)
                ev += torch.stack([err.mean(-1).sum(), err[:, -1].sum(), torch.tensor(float(len(err)), device=device)])
        dist.all_reduce(ev)
        ade, fde = (ev[0] / ev[2]).item(), (ev[1] / ev[2]).item()
        logger.info("epoch %d | train loss %.4f | ADE %.3f FDE %.3f | %.0fs", epoch,
                    (loss_meter[0] / loss_meter[1]).item(), ade, fde, time.time() - t0)

        if rank == 0:
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.output_dir, "latest.pth"))
            if ade < best_ade:
                best_ade = ade
                torch.save(state, os.path.join(args.output_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
