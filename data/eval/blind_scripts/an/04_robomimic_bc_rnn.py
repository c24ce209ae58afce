"""BC-RNN on robomimic low-dim datasets (lift / can / square), data parallel.

    torchrun --nnodes=1 --nproc_per_node=4 04_robomimic_bc_rnn.py --config configs/bc_rnn_square_ph.yaml
"""
import argparse
import json
import os
import random
from dataclasses import dataclass, field, asdict

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import robomimic.utils.env_utils as EnvUtils
import robomimic.utils.file_utils as FileUtils


@dataclass
class Config:
    dataset: str = "datasets/square/ph/low_dim_v141.hdf5"
    output_dir: str = "trained_models/bc_rnn_square"
    obs_keys: list = field(default_factory=lambda: ["object", "robot0_eef_pos", "robot0_eef_quat",
                                                     "robot0_gripper_qpos"])
    seq_length: int = 10
    hidden_dim: int = 400
    num_layers: int = 2
    batch_size: int = 100
    lr: float = 1e-4
    num_epochs: int = 2000
    steps_per_epoch: int = 100
    val_ratio: float = 0.1
    rollout_every: int = 50
    rollout_n: int = 50
    rollout_horizon: int = 400
    save_every: int = 50
    seed: int = 1


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    return cfg


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SequenceDataset(Dataset):
    def __init__(self, path, demo_keys, obs_keys, seq_length):
        self.obs, self.actions, self.index = [], [], []
        with h5py.File(path, "r") as f:
            for d, key in enumerate(demo_keys):
                grp = f[f"data/{key}"]
                o = np.concatenate([grp[f"obs/{k}"][()] for k in obs_keys], axis=-1).astype(np.float32)
                a = grp["actions"][()].astype(np.float32)
                self.obs.append(o)
                self.actions.append(a)
                for t in range(len(a)):
                    self.index.append((d, t))
        self.seq_length = seq_length

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d, t = self.index[i]
        o, a = self.obs[d], self.actions[d]
        idx = np.minimum(np.arange(t, t + self.seq_length), len(a) - 1)  # repeat last frame as padding
        return torch.from_numpy(o[idx]), torch.from_numpy(a[idx])


class BCRNN(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden, layers):
        super().__init__()
        self.rnn = nn.LSTM(obs_dim, hidden, layers, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Linear(1024, act_dim), nn.Tanh())
        self.hidden, self.layers = hidden, layers

    def forward(self, obs, state=None):
        out, state = self.rnn(obs, state)
        return self.head(out), state


def run_rollouts(policy, cfg, env_meta, n, seed, device):
    env = EnvUtils.create_env_from_metadata(env_meta=env_meta, render=False, render_offscreen=False,
                                            use_image_obs=False)
    successes, returns = [], []
    for ep in range(n):
        np.random.seed(seed + ep)
        ob = env.reset()
        state, total, success = None, 0.0, False
        for _ in range(cfg.rollout_horizon):
            x = np.concatenate([ob[k] for k in cfg.obs_keys]).astype(np.float32)
            x = torch.from_numpy(x).to(device)[None, None]
            with torch.no_grad():
                a, state = policy(x, state)
            ob, r, done, _ = env.step(a[0, 0].cpu().numpy())
            total += r
            if env.is_success()["task"]:
                success = True
                break
            if done:
                break
        successes.append(float(success))
        returns.append(total)
    return successes, returns


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(cfg.seed + rank)

    with h5py.File(cfg.dataset, "r") as f:
        demos = sorted(f["data"].keys(), key=lambda k: int(k.split("_")[1]))
    n_val = int(len(demos) * cfg.val_ratio)
    np.random.shuffle(demos)
    train_keys, val_keys = demos[n_val:], demos[:n_val]

    train_ds = SequenceDataset(cfg.dataset, train_keys, cfg.obs_keys, cfg.seq_length)
    val_ds = SequenceDataset(cfg.dataset, val_keys, cfg.obs_keys, cfg.seq_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=4, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, cfg.batch_size, sampler=val_sampler, num_workers=2)

    obs_dim = train_ds.obs[0].shape[1]
    act_dim = train_ds.actions[0].shape[1]
    model = DDP(BCRNN(obs_dim, act_dim, cfg.hidden_dim, cfg.num_layers).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    env_meta = FileUtils.get_env_metadata_from_dataset(cfg.dataset)

    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        with open(os.path.join(cfg.output_dir, "split.json"), "w") as f:
            json.dump({"train": train_keys, "valid": val_keys}, f)
        log = open(os.path.join(cfg.output_dir, "log.txt"), "a")

    it = iter(train_dl)
    sampler_epoch = 0
    for epoch in range(1, cfg.num_epochs + 1):
        model.train()
        tr = torch.zeros(2, device=device)
        for _ in range(cfg.steps_per_epoch):
            try:
                obs, act = next(it)
            except StopIteration:
                sampler_epoch += 1
                train_sampler.set_epoch(sampler_epoch)
                it = iter(train_dl)
                obs, act = next(it)
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            pred, _ = model(obs)
            loss = nn.functional.mse_loss(pred, act)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for obs, act in val_dl:
                pred, _ = model(obs.to(device))
                va += torch.stack([nn.functional.mse_loss(pred, act.to(device), reduction="sum"),
                                   torch.tensor(float(act.numel()), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)

        msg = f"epoch {epoch} train {tr[0] / tr[1]:.5f} val {va[0] / va[1].clamp_min(1):.5f}"
        if epoch % cfg.rollout_every == 0:
            per_rank = cfg.rollout_n // world
            succ, rets = run_rollouts(model.module, cfg, env_meta, per_rank, seed=10_000 + rank * per_rank,
                                      device=device)
            s = torch.tensor([sum(succ), sum(rets), len(succ)], device=device, dtype=torch.float64)
            dist.all_reduce(s)
            msg += f" success {s[0] / s[2]:.3f} return {s[1] / s[2]:.2f}"

        if rank == 0:
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
            if epoch % cfg.save_every == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optim.state_dict(),
                            "epoch": epoch, "config": asdict(cfg)},
                           os.path.join(cfg.output_dir, f"model_epoch_{epoch}.pth"))

    if rank == 0:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
