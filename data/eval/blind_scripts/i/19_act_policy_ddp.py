"""ACT (action chunking transformer) on ALOHA sim episodes, DDP + torch.compile, sharded eval rollouts.

torchrun --standalone --nproc_per_node=4 19_act_policy_ddp.py data_dir=/data/aloha_sim_insertion_human
"""
import glob
import json
import os
import sys
import time
from dataclasses import dataclass

import gymnasium as gym
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops.misc import FrozenBatchNorm2d


@dataclass
class Cfg:
    data_dir: str = "/data/aloha_sim_insertion_human"
    env_id: str = "gym_aloha/AlohaInsertion-v0"
    out_dir: str = "ckpt/act_insertion"
    chunk: int = 100
    d: int = 512
    latent: int = 32
    kl_weight: float = 10.0
    bsz: int = 8
    lr: float = 1e-5
    epochs: int = 2000
    eval_every: int = 200
    eval_episodes: int = 50
    compile: bool = True
    resume: str = ""


def norm_stats(cfg, rank):
    """Global rank 0 computes stats once; everyone else waits at the barrier, then reads them."""
    path = os.path.join(cfg.data_dir, "norm_stats.json")
    if rank == 0 and not os.path.exists(path):
        q, a = [], []
        for f in sorted(glob.glob(os.path.join(cfg.data_dir, "episode_*.hdf5"))):
            with h5py.File(f, "r") as h:
                q.append(h["observations/qpos"][:])
                a.append(h["action"][:])
        q, a = np.concatenate(q), np.concatenate(a)
        stats = {"qpos_mean": q.mean(0).tolist(), "qpos_std": (q.std(0) + 1e-2).tolist(),
                 "act_mean": a.mean(0).tolist(), "act_std": (a.std(0) + 1e-2).tolist()}
        with open(path + ".tmp", "w") as fh:
            json.dump(stats, fh)
        os.replace(path + ".tmp", path)
    dist.barrier()
    with open(path) as fh:
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in json.load(fh).items()}


class ACTEpisodes(Dataset):
    def __init__(self, cfg, stats):
        self.files = sorted(glob.glob(os.path.join(cfg.data_dir, "episode_*.hdf5")))
        self.chunk, self.s = cfg.chunk, stats
        self.lens = []
        for f in self.files:
            with h5py.File(f, "r") as h:
                self.lens.append(h["action"].shape[0])

    def __len__(self):
        return len(self.files) * 50  # many random start points per episode per epoch

    def __getitem__(self, i):
        e = i % len(self.files)
        with h5py.File(self.files[e], "r") as h:
            t = np.random.randint(self.lens[e])
            img = torch.from_numpy(h["observations/images/top"][t]).permute(2, 0, 1).float() / 255
            qpos = torch.from_numpy(h["observations/qpos"][t]).float()
            act = torch.from_numpy(h["action"][t:t + self.chunk]).float()
        pad = torch.zeros(self.chunk, dtype=torch.bool)
        if act.size(0) < self.chunk:
            pad[act.size(0):] = True
            act = torch.cat([act, act[-1:].expand(self.chunk - act.size(0), -1)])
        qpos = (qpos - self.s["qpos_mean"]) / self.s["qpos_std"]
        act = (act - self.s["act_mean"]) / self.s["act_std"]
        return img, qpos, act, pad


class ACT(nn.Module):
    def __init__(self, cfg, qdim=14, adim=14):
        super().__init__()
        d = cfg.d
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(rn.children())[:-2])
        self.img_proj = nn.Conv2d(512, d, 1)
        self.q_proj, self.a_proj = nn.Linear(qdim, d), nn.Linear(adim, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.vae_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 4)
        self.to_latent = nn.Linear(d, 2 * cfg.latent)
        self.from_latent = nn.Linear(cfg.latent, d)
        self.tf = nn.Transformer(d, 8, 4, 7, 4 * d, 0.1, batch_first=True)
        self.queries = nn.Parameter(torch.randn(1, cfg.chunk, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 512, d) * 0.02)
        self.head = nn.Linear(d, adim)
        self.latent = cfg.latent

    def forward(self, img, qpos, actions=None, pad=None):
        B = img.size(0)
        if actions is not None:  # training: CVAE posterior over the chunk
            x = torch.cat([self.cls.expand(B, -1, -1), self.q_proj(qpos)[:, None], self.a_proj(actions)], 1)
            kpm = torch.cat([torch.zeros(B, 2, dtype=torch.bool, device=img.device), pad], 1)
            mu, logvar = self.to_latent(self.vae_enc(x, src_key_padding_mask=kpm)[:, 0]).chunk(2, -1)
            z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        else:
            mu = logvar = None
            z = torch.zeros(B, self.latent, device=img.device)
        feat = self.img_proj(self.backbone(img)).flatten(2).transpose(1, 2)
        src = torch.cat([self.from_latent(z)[:, None], self.q_proj(qpos)[:, None], feat], 1)
        src = src + self.pos[:, : src.size(1)]
        h = self.tf(src, self.queries.expand(B, -1, -1))
        return self.head(h), mu, logvar


@torch.no_grad()
def rollout_success(policy, cfg, stats, device, rank, world):
    policy.eval()
    env = gym.make(cfg.env_id, obs_type="pixels_agent_pos")
    succ, n = 0, 0
    for ep in range(rank, cfg.eval_episodes, world):  # this rank's share of the eval seeds
        obs, _ = env.reset(seed=10_000 + ep)
        done, plan, k, info = False, None, 0, {}
        while not done:
            if plan is None or k == cfg.chunk:
                img = torch.from_numpy(obs["pixels"]["top"]).permute(2, 0, 1).float()[None].to(device) / 255
                q = (torch.from_numpy(obs["agent_pos"]).float() - stats["qpos_mean"]) / stats["qpos_std"]
                plan = policy(img, q[None].to(device))[0][0].cpu() * stats["act_std"] + stats["act_mean"]
                k = 0
            obs, _, term, trunc, info = env.step(plan[k].numpy())
            k += 1
            done = term or trunc
        succ += int(info.get("is_success", False))
        n += 1
    env.close()
    policy.train()
    t = torch.tensor([succ, n], dtype=torch.float32, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1].clamp(min=1)).item()


def seed_worker(worker_id):
    # torch already gives each worker base_seed + id; mix in the rank so ranks draw different start points
    np.random.seed((torch.initial_seed() + 100_003 * int(os.environ["RANK"])) % 2**32)


def main():
    cfg = OmegaConf.merge(OmegaConf.structured(Cfg), OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    stats = norm_stats(cfg, rank)
    ds = ACTEpisodes(cfg, stats)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=cfg.bsz, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True,
                    worker_init_fn=seed_worker)

    if local_rank == 0:  # populate the torch hub cache once per node before every rank builds the backbone
        torchvision.models.resnet18(weights="IMAGENET1K_V1")
    dist.barrier()
    policy = ACT(cfg).to(device)
    opt = torch.optim.AdamW([{"params": [p for n, p in policy.named_parameters() if not n.startswith("backbone")]},
                             {"params": policy.backbone.parameters(), "lr": cfg.lr}], lr=cfg.lr, weight_decay=1e-4)
    start = 0
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        policy.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1
    ddp = DDP(policy, device_ids=[local_rank])
    train_step_model = torch.compile(ddp) if cfg.compile else ddp

    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        agg = torch.zeros(3, device=device)
        t0 = time.time()
        for img, qpos, act, pad in dl:
            img, qpos, act, pad = (x.to(device, non_blocking=True) for x in (img, qpos, act, pad))
            pred, mu, logvar = train_step_model(img, qpos, act, pad)
            l1 = (F.l1_loss(pred, act, reduction="none") * (~pad)[..., None]).mean()
            kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1).mean()
            loss = l1 + cfg.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([l1.detach(), kl.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch} l1 {agg[0] / agg[2]:.4f} kl {agg[1] / agg[2]:.4f} "
                  f"({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % cfg.eval_every == 0:
            sr = rollout_success(policy, cfg, stats, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} success_rate {sr:.3f}", flush=True)
                os.makedirs(cfg.out_dir, exist_ok=True)
                torch.save({"model": policy.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "stats": {k: v.tolist() for k, v in stats.items()}, "success": sr},
                           os.path.join(cfg.out_dir, f"act_ep{epoch + 1}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
