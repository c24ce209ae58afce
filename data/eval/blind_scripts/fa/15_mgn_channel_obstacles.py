"""
MeshGraphNet surrogate for 2D channel flow past random obstacle configurations
(OpenFOAM pimpleFoam, Re 100-1000).  Every case has its own unstructured mesh
(3k-25k cells), so the number of nodes per graph varies by almost 10x.

Input/output normalisation is learned online in the first part of training,
like the DeepMind implementation, with statistics summed over all ranks.

    torchrun --nproc_per_node=8 15_mgn_channel_obstacles.py --cfg configs/channel_mgn.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

FLUID, WALL, INLET, OUTLET, OBSTACLE = range(5)
N_TYPES = 5


class Normalizer(nn.Module):
    """Online normaliser; statistics are accumulated over the first `max_samples` rows (nodes or edges)."""

    def __init__(self, dim, max_samples=5e7, eps=1e-8):
        super().__init__()
        self.max_samples, self.eps = max_samples, eps
        self.register_buffer("acc_count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("acc_sum", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("acc_sum_sq", torch.zeros(dim, dtype=torch.float64))

    def forward(self, x, accumulate=True):
        if accumulate and self.acc_count < self.max_samples:
            self._accumulate(x.detach())
        return (x - self.mean()) / self.std()

    def inverse(self, x):
        return x * self.std() + self.mean()

    @torch.no_grad()
    def _accumulate(self, x):
        d = x.shape[1]
        buf = torch.cat([x.double().sum(0), (x.double() ** 2).sum(0)])
        if dist.is_initialized():
            dist.all_reduce(buf)
        self.acc_sum += buf[:d]
        self.acc_sum_sq += buf[d:]
        self.acc_count += x.shape[0]

    def mean(self):
        return (self.acc_sum / self.acc_count.clamp(min=1)).float()

    def std(self):
        n = self.acc_count.clamp(min=1)
        var = self.acc_sum_sq / n - (self.acc_sum / n) ** 2
        return var.clamp(min=0).sqrt().float().clamp(min=self.eps)


def mlp(i, o, h, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    if ln:
        layers.append(nn.LayerNorm(o))
    return nn.Sequential(*layers)


class GNBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge, self.node = mlp(3 * h, h, h), mlp(2 * h, h, h)

    def forward(self, x, e, ei):
        e2 = self.edge(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        x2 = self.node(torch.cat([x, scatter_add(e2, ei[1], 0, dim_size=x.shape[0])], -1))
        return x + x2, e + e2


class ChannelMGN(nn.Module):
    def __init__(self, h=128, n_mp=15):
        super().__init__()
        self.node_norm = Normalizer(3 + N_TYPES)   # u, v, p + type
        self.edge_norm = Normalizer(3)
        self.out_norm = Normalizer(3)
        self.enc_x, self.enc_e = mlp(3 + N_TYPES, h, h), mlp(3, h, h)
        self.blocks = nn.ModuleList(GNBlock(h) for _ in range(n_mp))
        self.dec = mlp(h, 3, h, ln=False)

    def inputs(self, state, nt, pos, ei):
        x = torch.cat([state, F.one_hot(nt, N_TYPES).float()], -1)
        r = pos[ei[0]] - pos[ei[1]]
        return x, torch.cat([r, r.norm(dim=-1, keepdim=True)], -1)

    def net(self, x, e, ei):
        x, e = self.enc_x(x), self.enc_e(e)
        for b in self.blocks:
            x, e = b(x, e, ei)
        return self.dec(x)

    def forward(self, state, nt, pos, ei, delta):
        x, e = self.inputs(state, nt, pos, ei)
        pred = self.net(self.node_norm(x), self.edge_norm(e), ei)
        target = self.out_norm(delta)
        m = nt == FLUID
        return ((pred - target) ** 2)[m].sum(-1).mean()

    @torch.no_grad()
    def advance(self, state, nt, pos, ei):
        x, e = self.inputs(state, nt, pos, ei)
        out = self.net(self.node_norm(x, False), self.edge_norm(e, False), ei)
        return state + self.out_norm.inverse(out)


class CaseSteps(Dataset):
    """Each case: <case>/mesh.npz (pos, edges, node_type) and <case>/fields.npy of shape [T, N, 3]."""

    def __init__(self, root, cases, noise=(0.02, 0.02, 0.0)):
        self.root, self.cases = root, cases
        self.noise = torch.tensor(noise)
        self.T = [np.load(os.path.join(root, c, "fields.npy"), mmap_mode="r").shape[0] - 1 for c in cases]
        self.index = [(c, t) for c, T in enumerate(self.T) for t in range(T)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        c, t = self.index[k]
        mesh = np.load(os.path.join(self.root, self.cases[c], "mesh.npz"))
        f = np.load(os.path.join(self.root, self.cases[c], "fields.npy"), mmap_mode="r")
        s0, s1 = torch.from_numpy(np.array(f[t])).float(), torch.from_numpy(np.array(f[t + 1])).float()
        nt = torch.from_numpy(mesh["node_type"]).long()
        s0 = s0 + torch.randn_like(s0) * self.noise * (nt == FLUID).unsqueeze(-1)
        return s0, s1 - s0, nt, torch.from_numpy(mesh["pos"]).float(), torch.from_numpy(mesh["edges"]).long()


def collate(samples):
    cols, off = [[], [], [], [], []], 0
    for s0, ds, nt, pos, ei in samples:
        for c, v in zip(cols, (s0, ds, nt, pos, ei + off)):
            c.append(v)
        off += s0.shape[0]
    return [torch.cat(c, 1 if j == 4 else 0) for j, c in enumerate(cols)]


@torch.no_grad()
def rollout(core, root, case, device, n_steps):
    mesh = np.load(os.path.join(root, case, "mesh.npz"))
    gt = torch.from_numpy(np.load(os.path.join(root, case, "fields.npy"))).float().to(device)
    nt = torch.from_numpy(mesh["node_type"]).long().to(device)
    pos = torch.from_numpy(mesh["pos"]).float().to(device)
    ei = torch.from_numpy(mesh["edges"]).long().to(device)
    fluid = (nt == FLUID).unsqueeze(-1)
    s, se = gt[0], []
    for t in range(min(n_steps, gt.shape[0] - 1)):
        s = torch.where(fluid, core.advance(s, nt, pos, ei), gt[t + 1])
        se.append(((s[:, :2] - gt[t + 1, :, :2]) ** 2).sum(-1).mean().item())
    return np.sqrt(np.mean(se))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(cfg["root"], "splits.yaml")) as f:
        splits = yaml.safe_load(f)
    train = CaseSteps(cfg["root"], splits["train"])
    sampler = DistributedSampler(train, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                        num_workers=cfg.get("workers", 6), pin_memory=True, drop_last=True)

    core = ChannelMGN(cfg["latent"], cfg["mp_steps"]).to(device)
    # normaliser sums are all-reduced inside the model, so buffers need no broadcast
    model = DDP(core, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])  # cfg lr is for the full 8-GPU batch
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.get("lr_gamma", 0.95))
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for s0, ds, nt, pos, ei in loader:
            s0, ds, nt = s0.to(device, non_blocking=True), ds.to(device, non_blocking=True), nt.to(device)
            pos, ei = pos.to(device), ei.to(device)
            loss = model(s0, nt, pos, ei, ds)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        if rank == 0:
            core.eval()
            rmse = [rollout(core, cfg["root"], c, device, cfg["rollout_steps"]) for c in splits["valid"][:6]]
            print(f"epoch {epoch}  loss {(tot[0] / tot[1]).item():.4e}  val rollout rmse {np.mean(rmse):.4e}  "
                  f"norm samples {int(core.node_norm.acc_count)}  {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": core.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
