"""BC-RNN on robomimic low-dim datasets (lift / can / square, ph or mh) with DDP.

    torchrun --nproc_per_node=4 03_robomimic_bc_rnn_lowdim.py \
        --dataset datasets/lift/ph/low_dim_v141.hdf5 --output runs/bc_rnn_lift
"""
import argparse
import datetime
import json
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import robomimic.utils.env_utils as EnvUtils
import robomimic.utils.file_utils as FileUtils
import robomimic.utils.obs_utils as ObsUtils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

OBS_KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--seq_length", type=int, default=10)
    ap.add_argument("--rnn_hidden", type=int, default=400)
    ap.add_argument("--rnn_layers", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--steps_per_epoch", type=int, default=100)
    ap.add_argument("--val_ratio", type=float, default=0.1)
    ap.add_argument("--rollout_every", type=int, default=50)
    ap.add_argument("--rollout_n", type=int, default=50)
    ap.add_argument("--horizon", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SequenceDataset(Dataset):
    """All length-`seq_length` windows of the given demos (padded at the end of each demo)."""

    def __init__(self, hdf5_path, demos, seq_length, stats):
        self.seq_length = seq_length
        self.obs, self.actions, self.index = [], [], []
        with h5py.File(hdf5_path, "r") as f:
            for ep, demo in enumerate(demos):
                g = f[f"data/{demo}"]
                obs = np.concatenate([g[f"obs/{k}"][()] for k in OBS_KEYS], axis=-1).astype(np.float32)
                self.obs.append((obs - stats["obs_mean"]) / stats["obs_std"])
                self.actions.append(g["actions"][()].astype(np.float32))
                self.index.extend((ep, t) for t in range(len(obs)))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        ep, t = self.index[i]
        T = len(self.actions[ep])
        idx = np.minimum(np.arange(t, t + self.seq_length), T - 1)
        pad = np.arange(t, t + self.seq_length) >= T
        return {
            "obs": torch.from_numpy(self.obs[ep][idx]),
            "actions": torch.from_numpy(self.actions[ep][idx]),
            "mask": torch.from_numpy(~pad),
        }


def compute_obs_stats(hdf5_path, demos):
    with h5py.File(hdf5_path, "r") as f:
        obs = np.concatenate([
            np.concatenate([f[f"data/{d}/obs/{k}"][()] for k in OBS_KEYS], axis=-1) for d in demos
        ])
    return {"obs_mean": obs.mean(0).astype(np.float32), "obs_std": (obs.std(0) + 1e-3).astype(np.float32)}


class BCRNN(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden=400, layers=2, mlp=(300, 400)):
        super().__init__()
        enc, d = [], obs_dim
        for h in mlp:
            enc += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.encoder = nn.Sequential(*enc)
        self.rnn = nn.LSTM(d, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, action_dim)

    def forward(self, obs, state=None):
        out, state = self.rnn(self.encoder(obs), state)
        return torch.tanh(self.head(out)), state


def infinite_batches(loader, sampler):
    """robomimic-style fixed-length epochs: keep cycling the loader, reshuffling on every pass."""
    n_pass = 0
    while True:
        sampler.set_epoch(n_pass)
        yield from loader
        n_pass += 1


@torch.no_grad()
def run_rollouts(policy, env, stats, device, n, horizon):
    policy.eval()
    successes, returns = 0, []
    for ep in range(n):
        obs = env.reset()
        state, total = None, 0.0
        for _ in range(horizon):
            x = np.concatenate([obs[k] for k in OBS_KEYS]).astype(np.float32)
            x = torch.from_numpy((x - stats["obs_mean"]) / stats["obs_std"]).to(device)[None, None]
            act, state = policy(x, state)
            obs, r, done, _ = env.step(act[0, 0].cpu().numpy())
            total += r
            if done or env.is_success()["task"]:
                break
        successes += int(env.is_success()["task"])
        returns.append(total)
    policy.train()
    return successes / n, float(np.mean(returns))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    with h5py.File(args.dataset, "r") as f:
        demos = sorted(f["data"].keys(), key=lambda d: int(d.split("_")[1]))
        action_dim = f[f"data/{demos[0]}/actions"].shape[-1]
    random.shuffle(demos)
    n_val = max(1, int(len(demos) * args.val_ratio))
    valid_demos, train_demos = demos[:n_val], demos[n_val:]

    stats = compute_obs_stats(args.dataset, train_demos)
    train_set = SequenceDataset(args.dataset, train_demos, args.seq_length, stats)
    valid_set = SequenceDataset(args.dataset, valid_demos, args.seq_length, stats)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4, drop_last=True,
                              pin_memory=True, persistent_workers=True)
    valid_shard = Subset(valid_set, range(rank, len(valid_set), world))
    valid_loader = DataLoader(valid_shard, args.batch_size, shuffle=False, num_workers=2)

    obs_dim = stats["obs_mean"].shape[0]
    model = BCRNN(obs_dim, action_dim, args.rnn_hidden, args.rnn_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    writer, env = None, None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))
        with open(os.path.join(args.output, "split.json"), "w") as fp:
            json.dump({"train": train_demos, "valid": valid_demos}, fp)
        np.savez(os.path.join(args.output, "obs_stats.npz"), **stats)
        ObsUtils.initialize_obs_utils_with_obs_specs({"obs": {"low_dim": OBS_KEYS}})
        env_meta = FileUtils.get_env_metadata_from_dataset(dataset_path=args.dataset)
        env = EnvUtils.create_env_from_metadata(env_meta=env_meta, render=False, render_offscreen=False,
                                                use_image_obs=False)

    best_success = -1.0
    batches = infinite_batches(train_loader, train_sampler)
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        train_loss = torch.zeros(2, device=device)
        for step in range(args.steps_per_epoch):
            batch = next(batches)
            obs = batch["obs"].to(device, non_blocking=True)
            act = batch["actions"].to(device, non_blocking=True)
            mask = batch["mask"].to(device, non_blocking=True).unsqueeze(-1).float()
            pred, _ = model(obs)
            loss = (((pred - act) ** 2) * mask).sum() / (mask.sum() * act.shape[-1])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            train_loss += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        val_loss = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in valid_loader:
                obs, act = batch["obs"].to(device), batch["actions"].to(device)
                mask = batch["mask"].to(device).unsqueeze(-1).float()
                pred, _ = model.module(obs)
                val_loss += torch.stack([(((pred - act) ** 2) * mask).sum(), mask.sum() * act.shape[-1]])
        dist.all_reduce(train_loss)
        dist.all_reduce(val_loss)

        if rank == 0:
            tl, vl = (train_loss[0] / train_loss[1]).item(), (val_loss[0] / val_loss[1]).item()
            writer.add_scalar("loss/train", tl, epoch)
            writer.add_scalar("loss/valid", vl, epoch)
            print(f"[epoch {epoch}] train {tl:.5f} valid {vl:.5f} ({time.time() - t0:.1f}s)")
            ckpt = {"model": model.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch,
                    "obs_stats": stats, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output, "last.pth"))
            if epoch % args.rollout_every == 0:
                sr, ret = run_rollouts(model.module, env, stats, device, args.rollout_n, args.horizon)
                writer.add_scalar("rollout/success_rate", sr, epoch)
                writer.add_scalar("rollout/return", ret, epoch)
                print(f"[epoch {epoch}] rollout success {sr:.2f} return {ret:.2f}")
                if sr > best_success:
                    best_success = sr
                    torch.save(ckpt, os.path.join(args.output, f"best_epoch{epoch}_sr{sr:.2f}.pth"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
