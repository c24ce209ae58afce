"""GNS on Water-3D: train with DDP, keep the best one-step checkpoint, then write
test-set rollouts (pickles readable by our render_rollout.py) from the best model.

    torchrun --nproc_per_node=4 12_gns_water3d_rollout.py --data /data/Water-3D --out /runs/water3d
"""
import argparse
import json
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter_add

SEQ = 6
KIN = 3


def build_mlp(i, o, hidden=128, norm=True):
    m = [nn.Linear(i, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, o)]
    if norm:
        m.append(nn.LayerNorm(o))
    return nn.Sequential(*m)


class Interaction(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_mlp = build_mlp(3 * h, h)
        self.node_mlp = build_mlp(2 * h, h)

    def forward(self, x, e, edge_index):
        snd, rcv = edge_index
        e_new = self.edge_mlp(torch.cat([x[snd], x[rcv], e], -1))
        x_new = self.node_mlp(torch.cat([x, scatter_add(e_new, rcv, 0, dim_size=x.size(0))], -1))
        return x + x_new, e + e_new


class LearnedSimulator(nn.Module):
    def __init__(self, metadata, noise_std, latent=128, mp_steps=10):
        super().__init__()
        d = metadata["dim"]
        self.radius = metadata["default_connectivity_radius"]
        self.register_buffer("bounds", torch.tensor(metadata["bounds"], dtype=torch.float32))
        t = lambda k: torch.tensor(metadata[k], dtype=torch.float32)
        self.register_buffer("vel_mean", t("vel_mean"))
        self.register_buffer("vel_std", torch.sqrt(t("vel_std") ** 2 + noise_std ** 2))
        self.register_buffer("acc_mean", t("acc_mean"))
        self.register_buffer("acc_std", torch.sqrt(t("acc_std") ** 2 + noise_std ** 2))
        self.embedding = nn.Embedding(9, 16)
        self.node_encoder = build_mlp((SEQ - 1) * d + 2 * d + 16, latent)
        self.edge_encoder = build_mlp(d + 1, latent)
        self.processor = nn.ModuleList(Interaction(latent) for _ in range(mp_steps))
        self.decoder = build_mlp(latent, d, norm=False)

    def forward(self, positions, particle_type, batch):
        recent = positions[:, -1]
        ei = radius_graph(recent, self.radius, batch, loop=True, max_num_neighbors=128)
        vel = (positions[:, 1:] - positions[:, :-1] - self.vel_mean) / self.vel_std
        b = torch.cat([recent - self.bounds[:, 0], self.bounds[:, 1] - recent], -1) / self.radius
        x = self.node_encoder(torch.cat([vel.flatten(1), b.clamp(-1, 1), self.embedding(particle_type)], -1))
        rel = (recent[ei[0]] - recent[ei[1]]) / self.radius
        e = self.edge_encoder(torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1))
        for blk in self.processor:
            x, e = blk(x, e, ei)
        return self.decoder(x)


class Windows(Dataset):
    def __init__(self, path):
        data = np.load(path, allow_pickle=True)["gns_data"]
        self.trajectories = [(np.float32(p), np.int64(t)) for p, t in data]
        self.windows = [(i, s) for i, (p, _) in enumerate(self.trajectories) for s in range(len(p) - SEQ)]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, k):
        i, s = self.windows[k]
        p, t = self.trajectories[i]
        return p[s:s + SEQ + 1].transpose(1, 0, 2), t


def collate(items):
    pos = torch.from_numpy(np.concatenate([a for a, _ in items]))
    typ = torch.from_numpy(np.concatenate([b for _, b in items]))
    batch = torch.cat([torch.full((len(b),), j) for j, (_, b) in enumerate(items)])
    return pos, typ, batch


def walk_noise(seq, std):
    n = seq.shape[1] - 1
    v = torch.cumsum(torch.randn_like(seq[:, 1:]) * std / n ** 0.5, 1)
    return torch.cat([torch.zeros_like(v[:, :1]), torch.cumsum(v, 1)], 1)


def one_step_loss(model, sim, pos, typ, batch, noise_std):
    hist, target = pos[:, :-1], pos[:, -1]
    noise = walk_noise(hist, noise_std) if noise_std > 0 else torch.zeros_like(hist)
    noise[typ == KIN] = 0
    hist = hist + noise
    acc = ((target + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2] - sim.acc_mean) / sim.acc_std
    pred = model(hist, typ, batch)
    m = (typ != KIN).float().unsqueeze(-1)
    return ((pred - acc) ** 2 * m).sum() / (m.sum() * acc.shape[-1])


@torch.no_grad()
def rollout(sim, positions, types, device):
    p = torch.from_numpy(np.float32(positions)).transpose(0, 1).to(device)
    t = torch.from_numpy(np.int64(types)).to(device)
    b = torch.zeros_like(t)
    cur, out = p[:, :SEQ], []
    for s in range(SEQ, p.shape[1]):
        acc = sim(cur, t, b) * sim.acc_std + sim.acc_mean
        nxt = 2 * cur[:, -1] - cur[:, -2] + acc
        nxt = torch.where((t == KIN).unsqueeze(-1), p[:, s], nxt)
        out.append(nxt)
        cur = torch.cat([cur[:, 1:], nxt[:, None]], 1)
    pred = torch.stack(out, 1)
    return pred.transpose(0, 1).cpu().numpy(), ((pred - p[:, SEQ:]) ** 2).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--noise-std", type=float, default=3e-4)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    meta = json.load(open(os.path.join(args.data, "metadata.json")))
    sim = LearnedSimulator(meta, args.noise_std).to(device)
    model = DDP(sim, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    start, best = 0, float("inf")
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best"]

    train, valid = Windows(os.path.join(args.data, "train.npz")), Windows(os.path.join(args.data, "valid.npz"))
    ts, vs = DistributedSampler(train), DistributedSampler(valid, shuffle=False)
    tl = DataLoader(train, args.batch_size, sampler=ts, collate_fn=collate, num_workers=4, pin_memory=True)
    vl = DataLoader(valid, args.batch_size, sampler=vs, collate_fn=collate, num_workers=2)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        ts.set_epoch(epoch)
        model.train()
        for i, (pos, typ, batch) in enumerate(tl):
            pos, typ, batch = pos.to(device), typ.to(device), batch.to(device)
            loss = one_step_loss(model, sim, pos, typ, batch, args.noise_std)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and i % 1000 == 0:
                print(f"epoch {epoch} iter {i} loss {loss.item():.5f}", flush=True)
        sched.step()

        model.eval()
        agg = torch.zeros(2, device=device)
        with torch.no_grad():
            for pos, typ, batch in vl:
                agg += torch.stack([one_step_loss(sim, sim, pos.to(device), typ.to(device), batch.to(device), 0.0),
                                    torch.tensor(1.0, device=device)])
        dist.all_reduce(agg)
        val = (agg[0] / agg[1]).item()
        if rank == 0:
            print(f"epoch {epoch} valid one-step {val:.5f}", flush=True)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best": min(best, val)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val < best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best = min(best, val)
        dist.barrier()
    dist.destroy_process_group()

    # test rollouts: single process, no collectives from here on
    if rank == 0:
        test_sim = LearnedSimulator(meta, args.noise_std).to(device)
        ck = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
        test_sim.load_state_dict(ck["model"])
        test_sim.eval()
        test = np.load(os.path.join(args.data, "test.npz"), allow_pickle=True)["gns_data"]
        mses = []
        for k, (p, t) in enumerate(test):
            pred, mse = rollout(test_sim, p, t, device)
            mses.append(mse)
            with open(os.path.join(args.out, f"rollout_test_{k}.pkl"), "wb") as f:
                pickle.dump({"predicted_rollout": pred, "ground_truth_rollout": np.float32(p)[SEQ:],
                             "initial_positions": np.float32(p)[:SEQ], "particle_types": t,
                             "metadata": meta}, f)
        print(f"test rollout mse {np.mean(mses):.4e} over {len(mses)} trajectories", flush=True)


if __name__ == "__main__":
    main()
