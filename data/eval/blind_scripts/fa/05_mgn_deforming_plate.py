"""
MeshGraphNets - deforming_plate (quasi-static hyperelastic plate pushed by an actuator).

Graph per time step:
  * mesh edges from the tetrahedral cells (fixed per trajectory)
  * world edges actuator -> plate for pairs closer than WORLD_RADIUS (rebuilt every step)
Outputs per node: displacement increment (3) and von Mises stress (1).

Run (1 node, 4 GPUs):
  torchrun --nproc_per_node 4 05_mgn_deforming_plate.py --root /data/deforming_plate --out ckpt/plate
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
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter_sum

NORMAL, OBSTACLE, HANDLE = 0, 1, 3
N_TYPES = 9
WORLD_RADIUS = 0.03


def make_mlp(din, dout, width=128, ln=True):
    m = nn.Sequential(nn.Linear(din, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, dout))
    return nn.Sequential(m, nn.LayerNorm(dout)) if ln else m


def tets_to_edges(cells):
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    e = np.concatenate([cells[:, list(p)] for p in pairs])
    e = np.unique(np.sort(e, 1), axis=0)
    return torch.from_numpy(np.concatenate([e, e[:, ::-1]]).T.copy()).long()


class PlateSteps(torch.utils.data.Dataset):
    def __init__(self, root, split, noise_std=0.003):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split))
                            if f.endswith(".npz"))
        self.noise_std = noise_std
        self.lens = [int(np.load(f, mmap_mode="r")["world_pos"].shape[0]) - 1 for f in self.files]
        self.cum = np.cumsum([0] + self.lens)
        self._edges = {}

    def __len__(self):
        return int(self.cum[-1])

    def __getitem__(self, idx):
        fi = int(np.searchsorted(self.cum, idx, side="right") - 1)
        t = int(idx - self.cum[fi])
        d = np.load(self.files[fi])
        if fi not in self._edges:
            self._edges[fi] = tets_to_edges(d["cells"])
        wp = torch.from_numpy(d["world_pos"][t]).float()
        wp_next = torch.from_numpy(d["world_pos"][t + 1]).float()
        nt = torch.from_numpy(d["node_type"]).long().view(-1)
        stress = torch.from_numpy(d["stress"][t + 1]).float().view(-1, 1)
        if self.noise_std > 0:
            noise = torch.randn_like(wp) * self.noise_std
            noise[nt != NORMAL] = 0
            wp = wp + noise
        return Data(world_pos=wp, next_pos=wp_next, mesh_pos=torch.from_numpy(d["mesh_pos"]).float(),
                    node_type=nt, stress=stress, edge_index=self._edges[fi], num_nodes=wp.shape[0])


def build_inputs(g):
    nt = g.node_type
    # kinematic velocity of the actuator is an input, zero elsewhere
    vel = torch.where((nt == OBSTACLE).unsqueeze(1), g.next_pos - g.world_pos, torch.zeros_like(g.world_pos))
    x = torch.cat([vel, F.one_hot(nt, N_TYPES).float()], 1)
    s, r = g.edge_index
    dw, dm = g.world_pos[s] - g.world_pos[r], g.mesh_pos[s] - g.mesh_pos[r]
    e_mesh = torch.cat([dw, dw.norm(dim=1, keepdim=True), dm, dm.norm(dim=1, keepdim=True)], 1)
    act = (nt == OBSTACLE).nonzero().view(-1)
    plate = (nt != OBSTACLE).nonzero().view(-1)
    pr = radius(g.world_pos[act], g.world_pos[plate], WORLD_RADIUS,
                batch_x=g.batch[act], batch_y=g.batch[plate], max_num_neighbors=16)
    world_ei = torch.stack([act[pr[1]], plate[pr[0]]])
    dww = g.world_pos[world_ei[0]] - g.world_pos[world_ei[1]]
    e_world = torch.cat([dww, dww.norm(dim=1, keepdim=True)], 1)
    y = torch.cat([g.next_pos - g.world_pos, g.stress], 1)
    return x, e_mesh, e_world, world_ei, y


class Processor(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f_mesh = make_mlp(3 * d, d)
        self.f_world = make_mlp(3 * d, d)
        self.f_node = make_mlp(3 * d, d)

    def forward(self, h, em, ew, mesh_ei, world_ei, has_contact):
        em2 = self.f_mesh(torch.cat([h[mesh_ei[0]], h[mesh_ei[1]], em], 1))
        m_agg = scatter_sum(em2, mesh_ei[1], 0, dim_size=h.shape[0])
        if has_contact:
            ew2 = self.f_world(torch.cat([h[world_ei[0]], h[world_ei[1]], ew], 1))
            w_agg = scatter_sum(ew2, world_ei[1], 0, dim_size=h.shape[0])
            ew = ew + ew2
        else:
            w_agg = torch.zeros_like(m_agg)
        return h + self.f_node(torch.cat([h, m_agg, w_agg], 1)), em + em2, ew


class PlateNet(nn.Module):
    def __init__(self, stats, d=128, n_mp=15):
        super().__init__()
        for k, v in stats.items():
            self.register_buffer(k, torch.as_tensor(v, dtype=torch.float32))
        self.enc_node = make_mlp(3 + N_TYPES, d)
        self.enc_mesh = make_mlp(8, d)
        self.enc_world = make_mlp(4, d)
        self.proc = nn.ModuleList(Processor(d) for _ in range(n_mp))
        self.dec = make_mlp(d, 4, ln=False)

    def forward(self, x, e_mesh, e_world, mesh_ei, world_ei):
        has_contact = world_ei.shape[1] > 0
        h = self.enc_node((x - self.x_mean) / self.x_std)
        em = self.enc_mesh((e_mesh - self.em_mean) / self.em_std)
        ew = self.enc_world((e_world - self.ew_mean) / self.ew_std) if has_contact else None
        for blk in self.proc:
            h, em, ew = blk(h, em, ew, mesh_ei, world_ei, has_contact)
        return self.dec(h)


@torch.no_grad()
def gather_stats(ds, n_samples=2000, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(ds), size=min(n_samples, len(ds)), replace=False)
    sums = {}
    for i in idx:
        g = ds[int(i)]
        g.batch = torch.zeros(g.num_nodes, dtype=torch.long)
        x, em, ew, _, y = build_inputs(g)
        for k, v in (("x", x), ("em", em), ("ew", ew), ("y", y)):
            s = sums.setdefault(k, [0.0, 0.0, 0])
            s[0] = s[0] + v.double().sum(0)
            s[1] = s[1] + (v.double() ** 2).sum(0)
            s[2] += v.shape[0]
    out = {}
    for k, (a, b, n) in sums.items():
        mu = a / max(n, 1)
        out[f"{k}_mean"] = mu.float()
        out[f"{k}_std"] = (b / max(n, 1) - mu ** 2).clamp(min=1e-10).sqrt().float().clamp(min=1e-8)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--stress-weight", type=float, default=1.0)
    args = ap.parse_args()

    lrank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lrank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{lrank}")

    train_ds = PlateSteps(args.root, "train")
    holder = [None]
    if rank == 0:
        holder[0] = gather_stats(PlateSteps(args.root, "train", noise_std=0.0))
    dist.broadcast_object_list(holder, src=0)
    stats = holder[0]

    net = PlateNet(stats).to(dev)
    model = DDP(net, device_ids=[lrank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.3)

    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_ds = PlateSteps(args.root, "valid", noise_std=0.0)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, g in enumerate(loader):
            g = g.to(dev, non_blocking=True)
            x, em, ew, wei, y = build_inputs(g)
            pred = model(x, em, ew, g.edge_index, wei)
            yn = (y - net.y_mean) / net.y_std
            err = (pred - yn) ** 2
            loss_pos = err[:, :3].sum(1)[g.node_type == NORMAL].mean()
            loss = loss_pos + args.stress_weight * err[:, 3].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} it {i}/{len(loader)} loss {loss.item():.4e}", flush=True)
        sched.step()

        model.eval()
        acc = torch.zeros(4, device=dev)
        with torch.no_grad():
            for g in val_loader:
                g = g.to(dev)
                x, em, ew, wei, y = build_inputs(g)
                pred = net(x, em, ew, g.edge_index, wei) * net.y_std + net.y_mean
                m = g.node_type == NORMAL
                acc[0] += ((pred[m, :3] - y[m, :3]) ** 2).sum()
                acc[1] += ((pred[:, 3] - y[:, 3]) ** 2).sum()
                acc[2] += m.sum()
                acc[3] += y.shape[0]
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val pos-mse {(acc[0] / acc[2]).item():.3e} "
                  f"stress-mse {(acc[1] / acc[3]).item():.3e}", flush=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "stats": stats},
                       os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
