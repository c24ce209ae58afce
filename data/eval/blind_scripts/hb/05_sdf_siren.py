#!/usr/bin/env python3
"""Point-cloud-conditioned SDF network (SIREN decoder, eikonal + normal losses).

Meshes are sampled once into a cache of surface points / normals / near-surface SDF samples.

  torchrun --nnodes=1 --nproc_per_node=8 05_sdf_siren.py --mesh_dir data/thingi10k/meshes --cache_dir data/thingi10k/cache
"""
import argparse
import glob
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import trimesh
from tqdm import tqdm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def sample_mesh(path, n_surface=100000, n_near=100000, sigma=(0.005, 0.02)):
    mesh = trimesh.load(path, force="mesh", process=False)
    mesh.apply_translation(-mesh.bounding_box.centroid)
    mesh.apply_scale(1.8 / mesh.extents.max())
    surf, face_idx = trimesh.sample.sample_surface(mesh, n_surface)
    normals = mesh.face_normals[face_idx]
    near = []
    for s in sigma:
        idx = np.random.randint(0, n_surface, n_near // len(sigma))
        near.append(surf[idx] + s * np.random.randn(len(idx), 3))
    near = np.concatenate(near, 0)
    sdf = -trimesh.proximity.signed_distance(mesh, near)  # trimesh: positive inside
    return surf.astype(np.float32), normals.astype(np.float32), near.astype(np.float32), sdf.astype(np.float32)


def build_cache(mesh_dir, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    index_path = os.path.join(cache_dir, "index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            return json.load(f)
    names = []
    for path in tqdm(sorted(glob.glob(os.path.join(mesh_dir, "*.obj"))), desc="sampling meshes"):
        name = os.path.splitext(os.path.basename(path))[0]
        out = os.path.join(cache_dir, name + ".npz")
        if not os.path.exists(out):
            try:
                surf, nrm, near, sdf = sample_mesh(path)
            except Exception as e:  # broken / non-manifold files in the raw dump
                print(f"skip {name}: {e}")
                continue
            np.savez(out, surface=surf, normals=nrm, near=near, sdf=sdf)
        names.append(name)
    with open(index_path, "w") as f:
        json.dump(names, f)
    return names


class SDFCache(Dataset):
    def __init__(self, cache_dir, names, n_in=2048, n_surf=4096, n_near=4096):
        self.cache_dir, self.names = cache_dir, names
        self.n_in, self.n_surf, self.n_near = n_in, n_surf, n_near

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.cache_dir, self.names[i] + ".npz"))
        surf, nrm = d["surface"], d["normals"]
        a = np.random.randint(0, len(surf), self.n_in)
        b = np.random.randint(0, len(surf), self.n_surf)
        c = np.random.randint(0, len(d["near"]), self.n_near)
        return {
            "cond": torch.from_numpy(surf[a]),
            "surf": torch.from_numpy(surf[b]),
            "normals": torch.from_numpy(nrm[b]),
            "near": torch.from_numpy(d["near"][c]),
            "sdf": torch.from_numpy(d["sdf"][c]),
        }


class SineLayer(nn.Module):
    def __init__(self, cin, cout, w0=30.0, first=False):
        super().__init__()
        self.w0 = w0
        self.linear = nn.Linear(cin, cout)
        with torch.no_grad():
            bound = 1 / cin if first else np.sqrt(6 / cin) / w0
            self.linear.weight.uniform_(-bound, bound)

    def forward(self, x):
        return torch.sin(self.w0 * self.linear(x))


class PointEncoder(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.mlp1 = nn.Sequential(nn.Linear(3, 128), nn.ReLU(), nn.Linear(128, 256))
        self.mlp2 = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, p):
        h = self.mlp1(p)
        h = torch.cat([h, h.max(1, keepdim=True)[0].expand_as(h)], -1)
        return self.mlp2(h).max(1)[0]


class ConditionalSiren(nn.Module):
    def __init__(self, z_dim=256, hidden=256, n_layers=5):
        super().__init__()
        self.encoder = PointEncoder(z_dim)
        self.film = nn.Linear(z_dim, 2 * hidden * n_layers)
        self.first = SineLayer(3, hidden, first=True)
        self.layers = nn.ModuleList([SineLayer(hidden, hidden) for _ in range(n_layers - 1)])
        self.out = nn.Linear(hidden, 1)
        self.n_layers, self.hidden = n_layers, hidden

    def forward(self, cond, x):
        z = self.encoder(cond)
        gamma, beta = self.film(z).view(-1, self.n_layers, 2, self.hidden).unbind(2)
        h = self.first(x) * (1 + gamma[:, 0, None]) + beta[:, 0, None]
        for k, layer in enumerate(self.layers, start=1):
            h = layer(h) * (1 + gamma[:, k, None]) + beta[:, k, None]
        return self.out(h).squeeze(-1)


def gradient(y, x):
    return torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--out", default="runs/cond_siren")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--w_sdf", type=float, default=3e3)
    ap.add_argument("--w_normal", type=float, default=1e2)
    ap.add_argument("--w_eik", type=float, default=5e1)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    names = build_cache(args.mesh_dir, args.cache_dir)
    dataset = SDFCache(args.cache_dir, names)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = DDP(ConditionalSiren().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(dataset)} shapes, {len(loader)} iters/epoch/rank, world {world}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        meter = torch.zeros(4, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            surf = batch["surf"].requires_grad_(True)
            near = batch["near"].requires_grad_(True)
            off = (torch.rand_like(near) * 2 - 1).requires_grad_(True)

            pts = torch.cat([surf, near, off], 1)
            sdf = model(batch["cond"], pts)
            n_s, n_n = surf.shape[1], near.shape[1]
            grad = gradient(sdf, pts)

            l_surf = sdf[:, :n_s].abs().mean()
            l_near = (sdf[:, n_s:n_s + n_n] - batch["sdf"]).abs().mean()
            l_norm = (1 - F.cosine_similarity(grad[:, :n_s], batch["normals"], dim=-1)).mean()
            l_eik = ((grad.norm(dim=-1) - 1) ** 2).mean()
            loss = args.w_sdf * (l_surf + l_near) + args.w_normal * l_norm + args.w_eik * l_eik

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.stack([loss.detach(), l_surf.detach() + l_near.detach(),
                                  l_eik.detach(), torch.ones((), device=device)])

        dist.all_reduce(meter)
        if rank == 0:
            m = (meter[:3] / meter[3]).tolist()
            print(f"epoch {epoch} loss {m[0]:.4f} sdf {m[1]:.5f} eik {m[2]:.5f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
