"""GNS (Sanchez-Gonzalez et al. 2020) on granular flow (Sand / SandRamps).

Step-based training as in the reference implementation; multi-GPU with DDP.

  torchrun --nproc_per_node=4 04_gns_sand_train.py --data_path /scratch/gns/Sand \
      --model_path /scratch/gns/models/sand --ntraining_steps 2000000
"""
import argparse
import glob
import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter

C = 6  # input sequence length
KINEMATIC = 3


def mlp(sizes, layernorm=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    if layernorm:
        layers.append(nn.LayerNorm(sizes[-1]))
    return nn.Sequential(*layers)


class InteractionNetwork(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_fn = mlp([3 * h, h, h, h])
        self.node_fn = mlp([2 * h, h, h, h])

    def forward(self, x, edge_index, edge_attr):
        src, dst = edge_index
        e = self.edge_fn(torch.cat([x[dst], x[src], edge_attr], dim=-1))
        aggr = scatter(e, dst, dim=0, dim_size=x.shape[0], reduce="sum")
        x_new = self.node_fn(torch.cat([aggr, x], dim=-1))
        return x + x_new, edge_attr + e


class Simulator(nn.Module):
    def __init__(self, meta, h=128, mp_steps=10, emb=16, noise_std=6.7e-4):
        super().__init__()
        dim = meta["dim"]
        self.r = meta["default_connectivity_radius"]
        self.register_buffer("bounds", torch.tensor(meta["bounds"], dtype=torch.float32))
        self.register_buffer("vel_mean", torch.tensor(meta["vel_mean"], dtype=torch.float32))
        self.register_buffer("vel_std", torch.sqrt(torch.tensor(meta["vel_std"]) ** 2 + noise_std ** 2))
        self.register_buffer("acc_mean", torch.tensor(meta["acc_mean"], dtype=torch.float32))
        self.register_buffer("acc_std", torch.sqrt(torch.tensor(meta["acc_std"]) ** 2 + noise_std ** 2))
        self.emb = nn.Embedding(9, emb)
        self.enc_node = mlp([(C - 1) * dim + 2 * dim + emb, h, h, h])
        self.enc_edge = mlp([dim + 1, h, h, h])
        self.gn = nn.ModuleList([InteractionNetwork(h) for _ in range(mp_steps)])
        self.dec = mlp([h, h, h, dim], layernorm=False)

    def encode(self, pos_seq, batch, ptype):
        last = pos_seq[:, -1]
        vel = pos_seq[:, 1:] - pos_seq[:, :-1]
        ei = radius_graph(last, r=self.r, batch=batch, loop=True, max_num_neighbors=128)
        nvel = ((vel - self.vel_mean) / self.vel_std).flatten(1)
        db = torch.cat([last - self.bounds[:, 0], self.bounds[:, 1] - last], 1) / self.r
        x = torch.cat([nvel, db.clamp(-1, 1), self.emb(ptype)], 1)
        d = (last[ei[0]] - last[ei[1]]) / self.r
        return x, torch.cat([d, d.norm(dim=-1, keepdim=True)], 1), ei

    def acc(self, pos_seq, batch, ptype):
        x, e, ei = self.encode(pos_seq, batch, ptype)
        x, e = self.enc_node(x), self.enc_edge(e)
        for layer in self.gn:
            x, e = layer(x, ei, e)
        return self.dec(x)

    def forward(self, pos_seq, batch, ptype):
        return self.acc(pos_seq, batch, ptype)

    def next_position(self, pos_seq, batch, ptype):
        a = self.acc(pos_seq, batch, ptype) * self.acc_std + self.acc_mean
        return 2 * pos_seq[:, -1] - pos_seq[:, -2] + a


class SamplesDataset(Dataset):
    def __init__(self, path):
        raw = np.load(path, allow_pickle=True)
        self.data = [raw[k] for k in raw.files]
        self.index = []
        for i, (pos, _) in enumerate(self.data):
            self.index.extend((i, t) for t in range(pos.shape[0] - C))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, t = self.index[k]
        pos, ptype = self.data[i]
        seq = np.transpose(pos[t:t + C + 1], (1, 0, 2)).astype(np.float32)
        return seq[:, :-1], seq[:, -1], ptype.astype(np.int64)


def collate(items):
    seq = torch.from_numpy(np.concatenate([it[0] for it in items]))
    nxt = torch.from_numpy(np.concatenate([it[1] for it in items]))
    pt = torch.from_numpy(np.concatenate([it[2] for it in items]))
    batch = torch.cat([torch.full((it[0].shape[0],), b, dtype=torch.long) for b, it in enumerate(items)])
    return seq, nxt, pt, batch


def noise_like(seq, std):
    v = seq[:, 1:] - seq[:, :-1]
    vn = torch.cumsum(torch.randn_like(v) * (std / (v.shape[1] ** 0.5)), 1)
    return torch.cat([torch.zeros_like(vn[:, :1]), torch.cumsum(vn, 1)], 1)


def one_step_loss(model, sim, seq, nxt, pt, batch, noise_std):
    noise = noise_like(seq, noise_std)
    noise[pt == KINEMATIC] = 0
    noisy = seq + noise
    pred = model(noisy, batch, pt)
    target = (nxt + noise[:, -1]) - 2 * noisy[:, -1] + noisy[:, -2]
    target = (target - sim.acc_mean) / sim.acc_std
    mask = (pt != KINEMATIC).float().unsqueeze(1)
    return (((pred - target) ** 2) * mask).sum() / (mask.sum() * target.shape[1])


def latest_checkpoint(model_path):
    files = glob.glob(os.path.join(model_path, "model-*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.findall(r"model-(\d+)\.pt", f)[0]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", required=True)
    p.add_argument("--model_path", required=True)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--noise_std", type=float, default=6.7e-4)
    p.add_argument("--ntraining_steps", type=int, default=2_000_000)
    p.add_argument("--nsave_steps", type=int, default=5000)
    p.add_argument("--lr_init", type=float, default=1e-4)
    p.add_argument("--lr_decay", type=float, default=0.1)
    p.add_argument("--lr_decay_steps", type=int, default=5_000_000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    with open(os.path.join(args.data_path, "metadata.json")) as f:
        meta = json.load(f)
    sim = Simulator(meta, noise_std=args.noise_std).to(dev)
    model = DDP(sim, device_ids=[local_rank])
    lr0 = args.lr_init * world
    opt = torch.optim.Adam(model.parameters(), lr=lr0)

    step = 0
    ck = latest_checkpoint(args.model_path)
    if ck is not None:
        state = torch.load(ck, map_location=dev)
        sim.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {ck} at step {step}")

    train = SamplesDataset(os.path.join(args.data_path, "train.npz"))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    valid = SamplesDataset(os.path.join(args.data_path, "valid.npz"))
    vsampler = DistributedSampler(valid, shuffle=False)
    vloader = DataLoader(valid, batch_size=args.batch_size, sampler=vsampler, collate_fn=collate, num_workers=2)

    os.makedirs(args.model_path, exist_ok=True)
    done = False
    while not done:
        model.train()
        for seq, nxt, pt, batch in loader:
            seq, nxt, pt, batch = seq.to(dev), nxt.to(dev), pt.to(dev), batch.to(dev)
            loss = one_step_loss(model, sim, seq, nxt, pt, batch, args.noise_std)
            opt.zero_grad()
            loss.backward()
            opt.step()

            lr = lr0 * (args.lr_decay ** (step / args.lr_decay_steps))
            for g in opt.param_groups:
                g["lr"] = lr
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step}/{args.ntraining_steps} loss={loss.item():.6f} lr={lr:.3e}", flush=True)

            if step % args.nsave_steps == 0:
                model.eval()
                vsum = torch.zeros(2, device=dev)
                with torch.no_grad():
                    for vseq, vnxt, vpt, vb in vloader:
                        vl = one_step_loss(sim, sim, vseq.to(dev), vnxt.to(dev), vpt.to(dev), vb.to(dev), 0.0)
                        vsum += torch.stack([vl, torch.ones((), device=dev)])
                dist.all_reduce(vsum)
                if rank == 0:
                    print(f"step {step} valid one-step loss {(vsum[0] / vsum[1]).item():.6f}", flush=True)
                    torch.save({"model": sim.state_dict(), "optimizer": opt.state_dict(), "step": step},
                               os.path.join(args.model_path, f"model-{step}.pt"))
                dist.barrier()
                model.train()

            if step >= args.ntraining_steps:
                done = True
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
