"""MeshGraphNets cloth model (sphere_dynamic): cloth with a moving obstacle.

Mesh edges come from the triangulation, world edges are built every step from
obstacle-to-cloth proximity. Normalisers accumulate statistics online during
the first training steps, as in the original implementation.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        03_mgn_sphere_cloth.py --data /shared/datasets/sphere_dynamic --out /shared/runs/sphere
"""
import argparse
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch_cluster import radius
from torch_scatter import scatter_add

NORMAL, OBSTACLE, HANDLE, NUM_NODE_TYPES = 0, 1, 3, 9


class Normalizer(nn.Module):
    """Online mean/std accumulator. Sums are all-reduced so every rank holds the same statistics."""

    def __init__(self, size, max_accumulations=10 ** 6, std_epsilon=1e-8):
        super().__init__()
        self.max_accumulations = max_accumulations
        self.std_epsilon = std_epsilon
        self.register_buffer("acc_count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("num_accumulations", torch.zeros((), dtype=torch.long))
        self.register_buffer("acc_sum", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("acc_sum_squared", torch.zeros(size, dtype=torch.float64))

    def forward(self, x, accumulate=True):
        if accumulate and self.num_accumulations < self.max_accumulations:
            self._accumulate(x.detach())
        return (x - self.mean()) / self.std()

    def inverse(self, x):
        return x * self.std() + self.mean()

    def _accumulate(self, x):
        packed = torch.cat([x.double().sum(0), (x.double() ** 2).sum(0),
                            torch.tensor([x.shape[0]], dtype=torch.float64, device=x.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        n = self.acc_sum.numel()
        self.acc_sum += packed[:n]
        self.acc_sum_squared += packed[n:2 * n]
        self.acc_count += packed[-1]
        self.num_accumulations += 1

    def mean(self):
        return (self.acc_sum / self.acc_count.clamp(min=1.0)).float()

    def std(self):
        c = self.acc_count.clamp(min=1.0)
        var = self.acc_sum_squared / c - (self.acc_sum / c) ** 2
        return torch.sqrt(var.clamp(min=0.0)).float().clamp(min=self.std_epsilon)


def mlp(i, o, h=128, ln=True):
    seq = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*(seq + [nn.LayerNorm(o)] if ln else seq))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mesh_edge = mlp(3 * d, d)
        self.world_edge = mlp(3 * d, d)
        self.node = mlp(3 * d, d)

    def forward(self, x, em, ew, mesh_ei, world_ei):
        em_new = self.mesh_edge(torch.cat([x[mesh_ei[0]], x[mesh_ei[1]], em], -1))
        agg_m = scatter_add(em_new, mesh_ei[1], dim=0, dim_size=x.size(0))
        if world_ei.shape[1] > 0:
            ew_new = self.world_edge(torch.cat([x[world_ei[0]], x[world_ei[1]], ew], -1))
            agg_w = scatter_add(ew_new, world_ei[1], dim=0, dim_size=x.size(0))
            ew = ew + ew_new
        else:
            agg_w = torch.zeros_like(agg_m)
        x = x + self.node(torch.cat([x, agg_m, agg_w], -1))
        return x, em + em_new, ew


class ClothModel(nn.Module):
    def __init__(self, latent=128, steps=15, world_radius=0.03):
        super().__init__()
        self.world_radius = world_radius
        self.node_norm = Normalizer(3 + NUM_NODE_TYPES)
        self.mesh_edge_norm = Normalizer(7)
        self.world_edge_norm = Normalizer(4)
        self.out_norm = Normalizer(3)
        self.node_enc = mlp(3 + NUM_NODE_TYPES, latent)
        self.mesh_enc = mlp(7, latent)
        self.world_enc = mlp(4, latent)
        self.blocks = nn.ModuleList([Block(latent) for _ in range(steps)])
        self.decoder = mlp(latent, 3, ln=False)

    def world_edges(self, world_pos, node_type, batch):
        obst = (node_type == OBSTACLE).nonzero().squeeze(1)
        cloth = (node_type != OBSTACLE).nonzero().squeeze(1)
        pair = radius(world_pos[obst], world_pos[cloth], self.world_radius,
                      batch_x=batch[obst], batch_y=batch[cloth], max_num_neighbors=32)
        return torch.stack([obst[pair[1]], cloth[pair[0]]])

    def features(self, world_pos, prev_pos, mesh_pos, node_type, mesh_ei, batch, accumulate):
        vel = world_pos - prev_pos
        x = torch.cat([vel, F.one_hot(node_type, NUM_NODE_TYPES).float()], -1)
        rw = world_pos[mesh_ei[0]] - world_pos[mesh_ei[1]]
        rm = mesh_pos[mesh_ei[0]] - mesh_pos[mesh_ei[1]]
        em = torch.cat([rw, rw.norm(dim=-1, keepdim=True), rm, rm.norm(dim=-1, keepdim=True)], -1)
        world_ei = self.world_edges(world_pos, node_type, batch)
        rww = world_pos[world_ei[0]] - world_pos[world_ei[1]]
        ew = torch.cat([rww, rww.norm(dim=-1, keepdim=True)], -1)
        return (self.node_norm(x, accumulate), self.mesh_edge_norm(em, accumulate),
                self.world_edge_norm(ew, accumulate), world_ei)

    def _net(self, x, em, ew, mesh_ei, world_ei):
        x, em, ew = self.node_enc(x), self.mesh_enc(em), self.world_enc(ew)
        for b in self.blocks:
            x, em, ew = b(x, em, ew, mesh_ei, world_ei)
        return self.decoder(x)

    def forward(self, world_pos, prev_pos, target_pos, mesh_pos, node_type, mesh_ei, batch):
        x, em, ew, world_ei = self.features(world_pos, prev_pos, mesh_pos, node_type, mesh_ei, batch, True)
        pred = self._net(x, em, ew, mesh_ei, world_ei)
        target_acc = self.out_norm(target_pos - 2 * world_pos + prev_pos)
        mask = node_type == NORMAL
        return ((pred - target_acc) ** 2).sum(-1)[mask].mean()

    @torch.no_grad()
    def step(self, world_pos, prev_pos, mesh_pos, node_type, mesh_ei, batch):
        x, em, ew, world_ei = self.features(world_pos, prev_pos, mesh_pos, node_type, mesh_ei, batch, False)
        acc = self.out_norm.inverse(self._net(x, em, ew, mesh_ei, world_ei))
        return 2 * world_pos + acc - prev_pos


class ClothTrajectories(Dataset):
    def __init__(self, root, split, noise_std=0.0, noise_gamma=0.1):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.noise_std, self.noise_gamma = noise_std, noise_gamma
        self.steps = np.load(self.files[0])["world_pos"].shape[0] - 2
        self.items = [(i, t) for i in range(len(self.files)) for t in range(1, self.steps + 1)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, t = self.items[k]
        d = np.load(self.files[i])
        wp = torch.from_numpy(d["world_pos"][t - 1:t + 2]).float()
        node_type = torch.from_numpy(d["node_type"]).long().view(-1)
        cur, target = wp[1], wp[2]
        if self.noise_std > 0:
            noise = torch.randn_like(cur) * self.noise_std
            noise[node_type != NORMAL] = 0
            cur = cur + noise
            target = target + (1.0 - self.noise_gamma) * noise
        return dict(world_pos=cur, prev_pos=wp[0], target_pos=target,
                    mesh_pos=torch.from_numpy(d["mesh_pos"]).float(), node_type=node_type,
                    mesh_ei=torch.from_numpy(d["mesh_edges"]).long())


def collate(items):
    out, off = {k: [] for k in items[0]}, 0
    out["batch"] = []
    for b, it in enumerate(items):
        n = it["world_pos"].shape[0]
        for k, v in it.items():
            out[k].append(v + off if k == "mesh_ei" else v)
        out["batch"].append(torch.full((n,), b, dtype=torch.long))
        off += n
    return {k: torch.cat(v, 1 if k == "mesh_ei" else 0) for k, v in out.items()}


@torch.no_grad()
def rollout(model, path, device, n_steps):
    d = np.load(path)
    gt = torch.from_numpy(d["world_pos"]).float().to(device)
    nt = torch.from_numpy(d["node_type"]).long().view(-1).to(device)
    mp = torch.from_numpy(d["mesh_pos"]).float().to(device)
    ei = torch.from_numpy(d["mesh_edges"]).long().to(device)
    batch = torch.zeros_like(nt)
    prev, cur = gt[0], gt[1]
    kinematic = (nt != NORMAL).unsqueeze(-1)
    errs = []
    for t in range(1, min(n_steps, gt.shape[0] - 1)):
        nxt = model.step(cur, prev, mp, nt, ei, batch)
        nxt = torch.where(kinematic, gt[t + 1], nxt)
        errs.append(((nxt - gt[t + 1]) ** 2).mean().item())
        prev, cur = cur, nxt
    return np.array(errs)


@dataclass
class Args:
    data: str
    out: str
    batch_size: int
    lr: float
    epochs: int
    noise_std: float
    eval_traj: int


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--noise-std", type=float, default=3e-3)
    p.add_argument("--eval-traj", type=int, default=4)
    return Args(**vars(p.parse_args()))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")  # current device was set above

    ds = ClothTrajectories(args.data, "train", args.noise_std)
    sampler = DistributedSampler(ds)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                    num_workers=6, pin_memory=True)

    core = ClothModel().to(device)
    # world-edge MLPs see no input on steps without contact
    model = DistributedDataParallel(core, device_ids=[local_rank], find_unused_parameters=True)
    # --lr is the single-GPU reference value; scale linearly with the global batch
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl))

    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        core.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    valid_files = sorted(os.path.join(args.data, "valid", f) for f in os.listdir(os.path.join(args.data, "valid")))
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for it, b in enumerate(dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = model(b["world_pos"], b["prev_pos"], b["target_pos"], b["mesh_pos"],
                         b["node_type"], b["mesh_ei"], b["batch"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if rank == 0:
            writer.add_scalar("train/loss", (tot[0] / tot[1]).item(), epoch)
            core.eval()
            errs = [rollout(core, f, device, 400) for f in valid_files[:args.eval_traj]]
            writer.add_scalar("valid/rollout_mse", float(np.mean([e.mean() for e in errs])), epoch)
            writer.add_scalar("valid/one_step_mse", float(np.mean([e[0] for e in errs])), epoch)
            torch.save({"model": core.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            print(f"[{epoch}] loss={(tot[0] / tot[1]).item():.4e} rollout={np.mean([e.mean() for e in errs]):.4e}",
                  flush=True)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
