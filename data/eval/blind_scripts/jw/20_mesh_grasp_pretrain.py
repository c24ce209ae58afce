"""Object-level grasp evaluator pretraining on ACRONYM objects.

Input: a point cloud sampled from the object mesh (partial view rendered from a
random camera) and a candidate parallel-jaw grasp; target: the simulated success
flag from ACRONYM (object still in the gripper after shaking in FleX).
At the end of each epoch the evaluator is used to rank sampled grasps and the
top grasp is executed in PyBullet on held-out objects, split over the GPUs.

    torchrun --nproc_per_node=8 20_mesh_grasp_pretrain.py --acronym /data/acronym --meshes /data/shapenetsem
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
import trimesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from sim.single_object import SingleObjectGraspSim


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--acronym", required=True)
    p.add_argument("--meshes", required=True)
    p.add_argument("--points", type=int, default=1024)
    p.add_argument("--grasps-per-object", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="objects per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--sim-objects", type=int, default=256)
    p.add_argument("--out", default="checkpoints/evaluator")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def load_acronym(h5_path, mesh_root):
    with h5py.File(h5_path, "r") as f:
        mesh_file = f["object/file"][()].decode()
        scale = float(f["object/scale"][()])
        T = f["grasps/transforms"][:].astype(np.float32)
        success = f["grasps/qualities/flex/object_in_gripper"][:].astype(np.float32)
    return os.path.join(mesh_root, mesh_file), scale, T, success


class AcronymObjects(Dataset):
    def __init__(self, files, mesh_root, points, grasps_per_object):
        self.files = files
        self.mesh_root = mesh_root
        self.points = points
        self.k = grasps_per_object

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        mesh_path, scale, T, success = load_acronym(self.files[i], self.mesh_root)
        mesh = trimesh.load(mesh_path, force="mesh")
        mesh.apply_scale(scale)
        pc, _ = trimesh.sample.sample_surface(mesh, self.points * 2)
        # crude partial view: keep the half facing a random direction
        view = np.random.randn(3)
        view /= np.linalg.norm(view)
        pc = pc[np.argsort(pc @ view)[-self.points:]].astype(np.float32)
        # balanced positives / negatives
        pos, neg = np.flatnonzero(success > 0.5), np.flatnonzero(success <= 0.5)
        half = self.k // 2
        sel = np.concatenate([np.random.choice(pos, half, replace=len(pos) < half) if len(pos) else
                              np.random.choice(neg, half),
                              np.random.choice(neg, self.k - half, replace=len(neg) < self.k - half)])
        center = pc.mean(0)
        pc = pc - center
        G = T[sel].copy()
        G[:, :3, 3] -= center
        return torch.from_numpy(pc), torch.from_numpy(G), torch.from_numpy(success[sel])


class GraspEvaluator(nn.Module):
    def __init__(self):
        super().__init__()
        self.pc_enc = nn.Sequential(nn.Conv1d(3, 64, 1), nn.GroupNorm(8, 64), nn.ReLU(),
                                    nn.Conv1d(64, 256, 1), nn.GroupNorm(8, 256), nn.ReLU(),
                                    nn.Conv1d(256, 512, 1))
        self.grasp_enc = nn.Sequential(nn.Linear(12, 128), nn.ReLU(), nn.Linear(128, 128))
        self.cls = nn.Sequential(nn.Linear(512 + 128, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, pc, grasps):
        B, K = grasps.shape[:2]
        f = self.pc_enc(pc.transpose(1, 2)).max(-1)[0][:, None].expand(B, K, -1)
        g = self.grasp_enc(grasps[..., :3, :].flatten(-2))
        return self.cls(torch.cat([f, g], -1)).squeeze(-1)


@torch.no_grad()
def sim_eval(model, files, mesh_root, points, device, n_candidates=200):
    model.eval()
    sim = SingleObjectGraspSim(gui=False)
    res = torch.zeros(2, device=device)
    for path in files:
        mesh_path, scale, T, _ = load_acronym(path, mesh_root)
        sim.load_object(mesh_path, scale)
        pc = sim.render_partial_cloud(points)
        cand = T[np.random.choice(len(T), n_candidates, replace=len(T) < n_candidates)]
        center = pc.mean(0)
        c = cand.copy()
        c[:, :3, 3] -= center
        logits = model(torch.from_numpy((pc - center).astype(np.float32))[None].to(device),
                       torch.from_numpy(c)[None].to(device))[0]
        best = int(logits.argmax())
        res[0] += float(sim.execute(cand[best]))
        res[1] += 1
        sim.remove_object()
    sim.close()
    dist.all_reduce(res)
    model.train()
    return (res[0] / res[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.acronym, "grasps", "*.h5")))
    rng = np.random.RandomState(0)
    perm = rng.permutation(len(files))
    test_files = [files[i] for i in perm[: args.sim_objects]]
    train_files = [files[i] for i in perm[args.sim_objects:]]

    train_ds = AcronymObjects(train_files, args.meshes, args.points, args.grasps_per_object)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(GraspEvaluator().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        m = torch.zeros(3, device=device)
        for pc, G, y in train_dl:
            pc, G, y = pc.to(device, non_blocking=True), G.to(device, non_blocking=True), y.to(device)
            logits = model(pc, G)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach() * y.numel(), ((logits > 0).float() == y).sum().float(),
                              torch.tensor(float(y.numel()), device=device)])
        sched.step()
        dist.all_reduce(m)

        sr = sim_eval(model.module, test_files[rank::world], args.meshes, args.points, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(m[0] / m[2]).item():.4f} acc {(m[1] / m[2]).item():.3f} "
                  f"sim top-1 success {sr:.3f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(), "sim_sr": sr}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if sr > best:
                best = sr
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
