"""MeshGraphNets on deforming_plate (hyper-elastic plate pressed by a rigid actuator).

Graph: mesh edges from the tetrahedra (cached once per trajectory) plus world edges
between actuator and plate nodes closer than a radius (rebuilt each step, often empty).
Target: per-node velocity of the plate; actuator nodes are kinematic.

    torchrun --standalone --nproc_per_node=8 19_mgn_deforming_plate.py --data /data/mgn/deforming_plate_h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.spatial import cKDTree
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NORMAL, OBSTACLE, HANDLE = 0, 1, 3
NUM_TYPES = 9


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="dir with train.h5 / valid.h5, one group per trajectory")
    ap.add_argument("--cache", default=None, help="edge cache dir (default: <data>/edge_cache)")
    ap.add_argument("--out", default="runs/deforming_plate")
    ap.add_argument("--latent", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--world-radius", type=float, default=0.03)
    ap.add_argument("--noise", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--grad-ckpt", action="store_true")
    return ap.parse_args()


def tets_to_edges(cells):
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    e = np.concatenate([cells[:, list(p)] for p in pairs], 0)
    e = np.unique(np.sort(e, 1), axis=0)
    return np.concatenate([e, e[:, ::-1]], 0).T.astype(np.int64)


def build_edge_cache(h5_path, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    split = os.path.splitext(os.path.basename(h5_path))[0]
    with h5py.File(h5_path, "r") as f:
        for key in f.keys():
            out = os.path.join(cache_dir, f"{split}_{key}.npy")
            if not os.path.exists(out):
                np.save(out + ".tmp.npy", tets_to_edges(f[key]["cells"][:]))
                os.replace(out + ".tmp.npy", out)


class PlateSteps(Dataset):
    def __init__(self, h5_path, cache_dir, radius, noise=0.0):
        self.h5_path, self.cache_dir, self.radius, self.noise = h5_path, cache_dir, radius, noise
        self.split = os.path.splitext(os.path.basename(h5_path))[0]
        with h5py.File(h5_path, "r") as f:
            self.keys = sorted(f.keys())
            self.T = f[self.keys[0]]["world_pos"].shape[0]
        self.f = None

    def __len__(self):
        return len(self.keys) * (self.T - 1)

    def __getitem__(self, idx):
        if self.f is None:
            self.f = h5py.File(self.h5_path, "r")
        key, t = self.keys[idx // (self.T - 1)], idx % (self.T - 1)
        g = self.f[key]
        node_type = g["node_type"][:].astype(np.int64)
        pos, nxt = g["world_pos"][t].astype(np.float32), g["world_pos"][t + 1].astype(np.float32)
        mesh_pos = g["mesh_pos"][:].astype(np.float32)
        edges = np.load(os.path.join(self.cache_dir, f"{self.split}_{key}.npy"))
        if self.noise > 0:
            pos = pos + (node_type == NORMAL)[:, None] * np.random.normal(0, self.noise, pos.shape).astype(np.float32)
        obst = np.where(node_type == OBSTACLE)[0]
        plate = np.where(node_type == NORMAL)[0]
        pairs = cKDTree(pos[obst]).query_ball_point(pos[plate], r=self.radius)
        w_src = [obst[j] for i, js in enumerate(pairs) for j in js]
        w_dst = [plate[i] for i, js in enumerate(pairs) for _ in js]
        world_edges = np.array([w_src + w_dst, w_dst + w_src], dtype=np.int64).reshape(2, -1)
        return {
            "node_type": torch.from_numpy(node_type), "pos": torch.from_numpy(pos),
            "mesh_pos": torch.from_numpy(mesh_pos), "next_pos": torch.from_numpy(nxt),
            "mesh_edges": torch.from_numpy(edges), "world_edges": torch.from_numpy(world_edges),
        }


def mlp(i, o, h, ln=True):
    m = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*(m + [nn.LayerNorm(o)])) if ln else nn.Sequential(*m)


class MultiEdgeBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.mesh_fn = mlp(3 * h, h, h)
        self.world_fn = mlp(3 * h, h, h)
        self.node_fn = mlp(3 * h, h, h)

    def forward(self, x, em, ew, mesh_edges, world_edges):
        em = em + self.mesh_fn(torch.cat([em, x[mesh_edges[0]], x[mesh_edges[1]]], -1))
        ew = ew + self.world_fn(torch.cat([ew, x[world_edges[0]], x[world_edges[1]]], -1))
        am = torch.zeros_like(x).index_add_(0, mesh_edges[1], em)
        aw = torch.zeros_like(x).index_add_(0, world_edges[1], ew)
        return x + self.node_fn(torch.cat([x, am, aw], -1)), em, ew


class PlateMGN(nn.Module):
    def __init__(self, h, steps, grad_ckpt=False):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.node_enc = mlp(3 + NUM_TYPES, h, h)
        self.mesh_enc = mlp(8, h, h)
        self.world_enc = mlp(4, h, h)
        self.blocks = nn.ModuleList([MultiEdgeBlock(h) for _ in range(steps)])
        self.dec = mlp(h, 3, h, ln=False)

    def forward(self, b):
        s, r = b["mesh_edges"]
        dw, dm = b["pos"][s] - b["pos"][r], b["mesh_pos"][s] - b["mesh_pos"][r]
        em = self.mesh_enc(torch.cat([dw, dw.norm(dim=-1, keepdim=True), dm, dm.norm(dim=-1, keepdim=True)], -1))
        ws, wr = b["world_edges"]
        dww = b["pos"][ws] - b["pos"][wr]
        # encoded even when there are no world edges: a Linear on an empty batch still
        # puts its weights in the autograd graph (zero gradient), as DDP expects
        ew = self.world_enc(torch.cat([dww, dww.norm(dim=-1, keepdim=True)], -1))
        actuator_vel = torch.where((b["node_type"] == OBSTACLE)[:, None], b["next_pos"] - b["pos"], torch.zeros_like(b["pos"]))
        x = self.node_enc(torch.cat([actuator_vel, nn.functional.one_hot(b["node_type"], NUM_TYPES).float()], -1))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x, em, ew = checkpoint(blk, x, em, ew, b["mesh_edges"], b["world_edges"], use_reentrant=False)
            else:
                x, em, ew = blk(x, em, ew, b["mesh_edges"], b["world_edges"])
        return self.dec(x)


VEL_SCALE = 1e-3  # typical per-step displacement of plate nodes


def step_loss(model, b):
    pred = model(b)
    target = (b["next_pos"] - b["pos"]) / VEL_SCALE
    mask = b["node_type"] == NORMAL
    return ((pred - target) ** 2).sum(-1)[mask].mean()


@torch.no_grad()
def evaluate(net, ds, indices, device):
    net.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for i in indices:
        b = {k: v.to(device) for k, v in ds[i].items()}
        s[0] += step_loss(net, b).double()
        s[1] += 1
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache = args.cache or os.path.join(args.data, "edge_cache")
    train_h5, valid_h5 = os.path.join(args.data, "train.h5"), os.path.join(args.data, "valid.h5")
    if rank == 0:
        build_edge_cache(train_h5, cache)
        build_edge_cache(valid_h5, cache)
    dist.barrier()

    train = PlateSteps(train_h5, cache, args.world_radius, noise=args.noise)
    valid = PlateSteps(valid_h5, cache, args.world_radius)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=None, sampler=sampler, num_workers=8, pin_memory=True, prefetch_factor=4)
    # validation: every 10th step, split over ranks without padding (no collectives in the
    # forward of the plain module, so the shards may differ in length)
    valid_idx = list(range(0, len(valid), 10))[rank::world]

    net = PlateMGN(args.latent, args.steps, grad_ckpt=args.grad_ckpt).to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=(1e-2) ** (1.0 / (args.epochs * len(loader))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for b in loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = step_loss(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        val = evaluate(net, valid, valid_idx, device)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s train {(acc[0] / acc[1]).item():.4e} valid {val:.4e}", flush=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val < best:
                best = val
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    # final check of the best weights, loaded on every rank onto its own GPU
    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    net.load_state_dict(state["model"])
    final = evaluate(net, valid, list(range(len(valid)))[rank::world], device)
    if rank == 0:
        print(f"best checkpoint (epoch {state['epoch']}): full-valid one-step loss {final:.4e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
