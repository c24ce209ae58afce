"""Edge-grasp style training on the cluster (2 nodes x 4 GPUs, started by srun).

Every training file holds one simulated scene: the fused point cloud and all
grasp attempts (approach point, contact point, success) executed in the
simulator.  Scenes are sharded by file across ranks; scenes hold different
numbers of grasps, so ranks see different numbers of batches per epoch.

sbatch script:
    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29517
    srun python 07_edge_grasp_slurm.py --data /lustre/grasp/edge_scenes --out /lustre/$USER/edge_grasp
"""
import argparse
import glob
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--k", type=int, default=32, help="neighbours around each approach point")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def setup_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=30))
    return rank, world_size, local_rank


class SceneGrasps(Dataset):
    """All grasp attempts of one scene; each item is (local patch around approach point, edge, label)."""

    def __init__(self, path, k):
        d = np.load(path)
        self.xyz = d["xyz"].astype(np.float32)
        self.normals = d["normals"].astype(np.float32)
        self.approach = d["approach_idx"]
        self.contact = d["contact_idx"]
        self.label = d["success"].astype(np.float32)
        self.k = k
        self._tree = None

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        if self._tree is None:
            from scipy.spatial import cKDTree
            self._tree = cKDTree(self.xyz)
        a = self.xyz[self.approach[i]]
        _, nn_idx = self._tree.query(a, k=self.k)
        patch = np.concatenate([self.xyz[nn_idx] - a, self.normals[nn_idx]], 1)
        c = self.xyz[self.contact[i]] - a
        edge = np.concatenate([c, self.normals[self.contact[i]], self.normals[self.approach[i]]])
        return torch.from_numpy(patch), torch.from_numpy(edge.astype(np.float32)), torch.tensor(self.label[i])


class EdgeGraspNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 256))
        self.edge = nn.Sequential(nn.Linear(9, 64), nn.ReLU(), nn.Linear(64, 128))
        self.cls = nn.Sequential(nn.Linear(256 + 128, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 1))

    def forward(self, patch, edge):
        g = self.patch(patch).max(1)[0]
        return self.cls(torch.cat([g, self.edge(edge)], -1)).squeeze(-1)


def shard_loader(files, args, shuffle):
    ds = ConcatDataset([SceneGrasps(f, args.k) for f in files])
    return DataLoader(ds, batch_size=args.batch, shuffle=shuffle, num_workers=args.workers,
                      pin_memory=True, drop_last=False)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(4, device=device)  # tp, fp, fn, correct
    n = torch.zeros(1, device=device)
    for patch, edge, y in loader:
        patch, edge, y = patch.to(device), edge.to(device), y.to(device)
        pred = (net(patch, edge) > 0).float()
        s[0] += (pred * y).sum()
        s[1] += (pred * (1 - y)).sum()
        s[2] += ((1 - pred) * y).sum()
        s[3] += (pred == y).sum()
        n += y.numel()
    dist.all_reduce(s)
    dist.all_reduce(n)
    net.train()
    precision = (s[0] / (s[0] + s[1]).clamp(min=1)).item()
    recall = (s[0] / (s[0] + s[2]).clamp(min=1)).item()
    return precision, recall, (s[3] / n.clamp(min=1)).item()


def main():
    args = parse_args()
    rank, world, local_rank = setup_slurm()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.npz")))
    val_files = sorted(glob.glob(os.path.join(args.data, "val", "*.npz")))
    train_loader = shard_loader(train_files[rank::world], args, shuffle=True)
    val_loader = shard_loader(val_files[rank::world], args, shuffle=False)

    net = EdgeGraspNet().to(device)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[30, 45], gamma=0.1)

    ckpt_path = os.path.join(args.out, "last.pt")
    start = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        net.module.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train scenes={len(train_files)} resume_from={start}", flush=True)

    for epoch in range(start, args.epochs):
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        # ranks run out of batches at different times; Join shadows the missing all-reduces
        with Join([net]):
            for patch, edge, y in train_loader:
                patch, edge, y = patch.to(device, non_blocking=True), edge.to(device), y.to(device)
                loss = F.binary_cross_entropy_with_logits(net(patch, edge), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        sched.step()
        dist.all_reduce(loss_sum)

        prec, rec, acc = evaluate(net.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val P {prec:.3f} R {rec:.3f} acc {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"epoch": epoch, "net": net.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
