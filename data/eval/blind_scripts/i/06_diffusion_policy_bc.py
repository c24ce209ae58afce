"""Diffusion-policy behaviour cloning on our teleop episodes (zarr per episode).

torchrun --standalone --nproc_per_node=4 06_diffusion_policy_bc.py data.root=/data/teleop/pick_place
"""
import copy
import glob
import logging
import os

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import zarr
from diffusers import DDPMScheduler
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)


class EpisodeWindows(Dataset):
    """All (obs_horizon, action_horizon) windows from a list of episodes."""

    def __init__(self, episode_paths, obs_h, act_h, stats):
        self.obs_h, self.act_h = obs_h, act_h
        self.eps, self.index = [], []
        for e, path in enumerate(episode_paths):
            z = zarr.open(path, mode="r")
            ep = {"img": z["rgb"][:], "state": z["qpos"][:], "action": z["action"][:]}
            self.eps.append(ep)
            T = len(ep["action"])
            for t in range(obs_h - 1, T - act_h + 1):
                self.index.append((e, t))
        self.stats = stats

    def __len__(self):
        return len(self.index)

    def _norm(self, x, key):
        lo, hi = self.stats[key]
        return 2 * (x - lo) / (hi - lo + 1e-6) - 1

    def __getitem__(self, i):
        e, t = self.index[i]
        ep = self.eps[e]
        img = ep["img"][t - self.obs_h + 1: t + 1].astype(np.float32) / 255.0
        state = self._norm(ep["state"][t - self.obs_h + 1: t + 1], "state")
        act = self._norm(ep["action"][t: t + self.act_h], "action")
        return (torch.from_numpy(img).permute(0, 3, 1, 2), torch.from_numpy(state).float(),
                torch.from_numpy(act).float())


def compute_stats(paths):
    s, a = [], []
    for p in paths:
        z = zarr.open(p, mode="r")
        s.append(z["qpos"][:])
        a.append(z["action"][:])
    s, a = np.concatenate(s), np.concatenate(a)
    return {"state": (s.min(0), s.max(0)), "action": (a.min(0), a.max(0))}


def resnet18_gn():
    net = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(c // 16, c))
    net.fc = nn.Identity()
    return net


class SinusoidalEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        f = torch.exp(-np.log(10000) * torch.arange(half, device=t.device) / (half - 1))
        x = t.float()[:, None] * f[None]
        return torch.cat([x.sin(), x.cos()], -1)


class NoisePredNet(nn.Module):
    """Small MLP denoiser conditioned on image features + proprio."""

    def __init__(self, act_dim, act_h, state_dim, obs_h, hidden=1024):
        super().__init__()
        self.enc = resnet18_gn()
        cond = obs_h * (512 + state_dim) + 128
        self.t_emb = nn.Sequential(SinusoidalEmb(128), nn.Linear(128, 128), nn.Mish())
        self.net = nn.Sequential(
            nn.Linear(act_dim * act_h + cond, hidden), nn.Mish(),
            nn.Linear(hidden, hidden), nn.Mish(),
            nn.Linear(hidden, hidden), nn.Mish(),
            nn.Linear(hidden, act_dim * act_h),
        )
        self.act_dim, self.act_h = act_dim, act_h

    def forward(self, noisy_act, t, img, state):
        B, To = img.shape[:2]
        feats = self.enc(img.flatten(0, 1)).view(B, To, -1)
        cond = torch.cat([feats, state], -1).flatten(1)
        x = torch.cat([noisy_act.flatten(1), cond, self.t_emb(t)], -1)
        return self.net(x).view(B, self.act_h, self.act_dim)


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


@hydra.main(config_path="conf", config_name="diffusion_policy", version_base=None)
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    episodes = sorted(glob.glob(os.path.join(cfg.data.root, "episode_*.zarr")))
    stats = compute_stats(episodes)
    # each rank owns a disjoint set of episodes -> no duplicate windows, less host RAM per process
    my_eps = episodes[rank::world]
    ds = EpisodeWindows(my_eps, cfg.obs_horizon, cfg.action_horizon, stats)
    dl = DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.num_workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        log.info(OmegaConf.to_yaml(cfg))
        log.info(f"{len(episodes)} episodes, rank0 has {len(ds)} windows / {len(dl)} batches")

    model = NoisePredNet(cfg.action_dim, cfg.action_horizon, cfg.state_dim, cfg.obs_horizon).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    sched = DDPMScheduler(num_train_timesteps=cfg.diffusion_steps, beta_schedule="squaredcos_cap_v2",
                          prediction_type="epsilon")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-6)
    lr_sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(dl))

    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        tot = torch.zeros(2, device=device)
        for img, state, act in dl:
            img, state, act = img.to(device), state.to(device), act.to(device)
            noise = torch.randn_like(act)
            t = torch.randint(0, sched.config.num_train_timesteps, (act.size(0),), device=device)
            noisy = sched.add_noise(act, noise, t)
            pred = model(noisy, t, img, state)
            loss = F.mse_loss(pred, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            lr_sched.step()
            ema_update(ema, model.module, cfg.ema_decay)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(tot)
        if rank == 0:
            log.info(f"epoch {epoch} step {step} loss {(tot[0] / tot[1]).item():.5f}")
            if (epoch + 1) % cfg.save_every == 0:
                torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "stats": stats, "cfg": OmegaConf.to_container(cfg)},
                           os.path.join(cfg.out_dir, f"dp_epoch{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
