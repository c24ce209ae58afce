"""Train a GNS particle simulator on the WaterRamps dataset with DDP.

    torchrun --nproc_per_node=4 01_gns_water_ramps.py --data-path /data/WaterRamps

Dataset layout follows the DeepMind learning_to_simulate release converted to
npz: train.npz / valid.npz / test.npz plus metadata.json.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter_add

INPUT_SEQUENCE_LENGTH = 6
NUM_PARTICLE_TYPES = 9
KINEMATIC_PARTICLE_ID = 3


def build_mlp(in_size, hidden, out_size, n_hidden=2, layer_norm=True):
    layers = [nn.Linear(in_size, hidden), nn.ReLU()]
    for _ in range(n_hidden - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, out_size))
    if layer_norm:
        layers.append(nn.LayerNorm(out_size))
    return nn.Sequential(*layers)


class InteractionNetwork(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.edge_fn = build_mlp(3 * latent, latent, latent)
        self.node_fn = build_mlp(2 * latent, latent, latent)

    def forward(self, x, e, edge_index):
        senders, receivers = edge_index
        e_new = self.edge_fn(torch.cat([x[senders], x[receivers], e], dim=-1))
        agg = scatter_add(e_new, receivers, dim=0, dim_size=x.size(0))
        x_new = self.node_fn(torch.cat([x, agg], dim=-1))
        return x + x_new, e + e_new


class LearnedSimulator(nn.Module):
    def __init__(self, dim, radius, boundaries, stats, latent=128, n_steps=10, emb_size=16):
        super().__init__()
        self.dim = dim
        self.radius = radius
        self.register_buffer("boundaries", torch.tensor(boundaries, dtype=torch.float32))
        for k, v in stats.items():
            self.register_buffer(k, torch.tensor(v, dtype=torch.float32))
        self.type_emb = nn.Embedding(NUM_PARTICLE_TYPES, emb_size)
        node_in = (INPUT_SEQUENCE_LENGTH - 1) * dim + 2 * dim + emb_size
        self.node_enc = build_mlp(node_in, latent, latent)
        self.edge_enc = build_mlp(dim + 1, latent, latent)
        self.processor = nn.ModuleList([InteractionNetwork(latent) for _ in range(n_steps)])
        self.decoder = build_mlp(latent, latent, dim, layer_norm=False)

    def _encode(self, position_sequence, n_particles, particle_types):
        batch = torch.repeat_interleave(
            torch.arange(len(n_particles), device=position_sequence.device), n_particles)
        recent = position_sequence[:, -1]
        velocities = position_sequence[:, 1:] - position_sequence[:, :-1]
        edge_index = radius_graph(recent, r=self.radius, batch=batch, loop=True, max_num_neighbors=128)

        norm_vel = (velocities - self.vel_mean) / self.vel_std
        node_feat = [norm_vel.flatten(1)]
        lower = recent - self.boundaries[:, 0]
        upper = self.boundaries[:, 1] - recent
        dist_b = torch.cat([lower, upper], dim=1) / self.radius
        node_feat.append(dist_b.clamp(-1.0, 1.0))
        node_feat.append(self.type_emb(particle_types))

        senders, receivers = edge_index
        rel = (recent[senders] - recent[receivers]) / self.radius
        edge_feat = torch.cat([rel, rel.norm(dim=-1, keepdim=True)], dim=-1)
        return torch.cat(node_feat, dim=-1), edge_feat, edge_index

    def _process(self, x, e, edge_index):
        x, e = self.node_enc(x), self.edge_enc(e)
        for block in self.processor:
            x, e = block(x, e, edge_index)
        return self.decoder(x)

    def _decode_positions(self, norm_acc, position_sequence):
        acc = norm_acc * self.acc_std + self.acc_mean
        last = position_sequence[:, -1]
        last_vel = last - position_sequence[:, -2]
        return last + last_vel + acc

    def predict_positions(self, position_sequence, n_particles, particle_types):
        x, e, ei = self._encode(position_sequence, n_particles, particle_types)
        return self._decode_positions(self._process(x, e, ei), position_sequence)

    def forward(self, next_positions, noise, position_sequence, n_particles, particle_types):
        noisy = position_sequence + noise
        x, e, ei = self._encode(noisy, n_particles, particle_types)
        pred_acc = self._process(x, e, ei)
        next_adj = next_positions + noise[:, -1]
        target_acc = next_adj - 2 * noisy[:, -1] + noisy[:, -2]
        target_acc = (target_acc - self.acc_mean) / self.acc_std
        return pred_acc, target_acc


def random_walk_noise(position_sequence, noise_std_last_step):
    velocity_sequence = position_sequence[:, 1:] - position_sequence[:, :-1]
    num_velocities = velocity_sequence.shape[1]
    step_std = noise_std_last_step / num_velocities ** 0.5
    vel_noise = torch.randn_like(velocity_sequence) * step_std
    vel_noise = torch.cumsum(vel_noise, dim=1)
    pos_noise = torch.cat([torch.zeros_like(vel_noise[:, :1]), torch.cumsum(vel_noise, dim=1)], dim=1)
    return pos_noise


class WindowDataset(Dataset):
    def __init__(self, path):
        data = np.load(path, allow_pickle=True)
        self.trajs = [(d[0].astype(np.float32), d[1].astype(np.int64)) for d in data["gns_data"]]
        self.index = [(i, t) for i, (pos, _) in enumerate(self.trajs)
                      for t in range(pos.shape[0] - INPUT_SEQUENCE_LENGTH)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        i, t = self.index[idx]
        pos, ptype = self.trajs[i]
        window = pos[t:t + INPUT_SEQUENCE_LENGTH + 1].transpose(1, 0, 2)
        return window[:, :-1], ptype, window[:, -1]


def collate(batch):
    seqs, types, targets = zip(*batch)
    n = torch.tensor([s.shape[0] for s in seqs])
    return (torch.from_numpy(np.concatenate(seqs)), torch.from_numpy(np.concatenate(types)),
            torch.from_numpy(np.concatenate(targets)), n)


@torch.no_grad()
def rollout(simulator, positions, particle_types, n_steps, device):
    positions = torch.from_numpy(positions).to(device).transpose(0, 1)
    particle_types = torch.from_numpy(particle_types).to(device)
    n = torch.tensor([positions.shape[0]], device=device)
    current = positions[:, :INPUT_SEQUENCE_LENGTH]
    kinematic = (particle_types == KINEMATIC_PARTICLE_ID).unsqueeze(-1)
    preds = []
    for step in range(n_steps):
        nxt = simulator.predict_positions(current, n, particle_types)
        gt = positions[:, INPUT_SEQUENCE_LENGTH + step]
        nxt = torch.where(kinematic, gt, nxt)
        preds.append(nxt)
        current = torch.cat([current[:, 1:], nxt[:, None]], dim=1)
    preds = torch.stack(preds, dim=1)
    gt = positions[:, INPUT_SEQUENCE_LENGTH:INPUT_SEQUENCE_LENGTH + n_steps]
    return ((preds - gt) ** 2).mean().item()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", required=True)
    p.add_argument("--out-dir", default="runs/water_ramps")
    p.add_argument("--batch-size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-final", type=float, default=1e-6)
    p.add_argument("--lr-decay-steps", type=int, default=5_000_000)
    p.add_argument("--noise-std", type=float, default=6.7e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--n-eval-traj", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    with open(os.path.join(args.data_path, "metadata.json")) as f:
        meta = json.load(f)
    stats = {
        "vel_mean": meta["vel_mean"], "vel_std": meta["vel_std"],
        "acc_mean": meta["acc_mean"], "acc_std": meta["acc_std"],
    }
    stats["vel_std"] = np.sqrt(np.array(stats["vel_std"]) ** 2 + args.noise_std ** 2).tolist()
    stats["acc_std"] = np.sqrt(np.array(stats["acc_std"]) ** 2 + args.noise_std ** 2).tolist()

    sim = LearnedSimulator(meta["dim"], meta["default_connectivity_radius"], meta["bounds"], stats).to(device)
    simulator = DDP(sim, device_ids=[local_rank])

    train_ds = WindowDataset(os.path.join(args.data_path, "train.npz"))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=args.workers, pin_memory=True, persistent_workers=True)
    valid = np.load(os.path.join(args.data_path, "valid.npz"), allow_pickle=True)["gns_data"]

    optimizer = torch.optim.Adam(simulator.parameters(), lr=args.lr * world)
    step = 0
    os.makedirs(args.out_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        simulator.train()
        t0 = time.time()
        for seq, ptype, target, n in loader:
            seq, ptype = seq.to(device, non_blocking=True), ptype.to(device, non_blocking=True)
            target, n = target.to(device, non_blocking=True), n.to(device)
            noise = random_walk_noise(seq, args.noise_std)
            noise[ptype == KINEMATIC_PARTICLE_ID] = 0.0

            pred_acc, target_acc = simulator(target, noise, seq, n, ptype)
            mask = (ptype != KINEMATIC_PARTICLE_ID).unsqueeze(-1)
            loss = (((pred_acc - target_acc) ** 2) * mask).sum() / mask.sum().clamp(min=1) / meta["dim"]

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            lr = (args.lr - args.lr_final) * 0.1 ** (step / args.lr_decay_steps) + args.lr_final
            for g in optimizer.param_groups:
                g["lr"] = lr * world
            step += 1
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} lr {lr:.2e}", flush=True)

        if rank == 0:
            print(f"epoch {epoch} finished in {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            if rank == 0:
                simulator.eval()
                mses = []
                for pos, pt in valid[:args.n_eval_traj]:
                    n_steps = pos.shape[0] - INPUT_SEQUENCE_LENGTH
                    mses.append(rollout(simulator, pos.astype(np.float32), pt.astype(np.int64), n_steps, device))
                print(f"epoch {epoch} valid rollout mse {np.mean(mses):.3e}", flush=True)
                torch.save({"model": simulator.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step, "epoch": epoch},
                           os.path.join(args.out_dir, f"model-{epoch:03d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
