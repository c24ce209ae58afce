"""ACT for bimanual ALOHA sim tasks, DDP training with sharded rollout evaluation.

Config is an OmegaConf dict; override from the command line:

    torchrun --nproc_per_node=4 08_act_bimanual_omegaconf.py \
        data.dir=data/sim_insertion_human task=gym_aloha/AlohaInsertion-v0 out=runs/act_insertion
"""
import glob
import os
import time

import gymnasium as gym
import gym_aloha  # noqa: F401
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

os.environ.setdefault("MUJOCO_GL", "egl")

DEFAULTS = {
    "task": "gym_aloha/AlohaInsertion-v0",
    "out": "runs/act",
    "seed": 0,
    "data": {"dir": "data/sim_insertion_human", "camera": "top", "num_workers": 4},
    "model": {"chunk": 100, "dim": 512, "heads": 8, "enc_layers": 4, "dec_layers": 7, "ff": 3200, "latent": 32},
    "train": {"global_batch": 64, "lr": 5e-5, "lr_backbone": 5e-6, "wd": 1e-4, "epochs": 500, "kl_weight": 10.0},
    "eval": {"every": 50, "n_episodes": 50, "max_steps": 500},
}


class AlohaEpisodes(Dataset):
    """Every (episode, timestep) pair is a sample; images are read lazily from the hdf5 files."""

    def __init__(self, files, camera, chunk):
        self.files, self.camera, self.chunk = files, camera, chunk
        self.qpos, self.action, self.index = [], [], []
        for e, fn in enumerate(files):
            with h5py.File(fn, "r") as f:
                self.qpos.append(f["observations/qpos"][()].astype(np.float32))
                self.action.append(f["action"][()].astype(np.float32))
            self.index += [(e, t) for t in range(len(self.action[-1]))]
        allq, alla = np.concatenate(self.qpos), np.concatenate(self.action)
        self.stats = {"q_mean": allq.mean(0), "q_std": allq.std(0).clip(1e-2),
                      "a_mean": alla.mean(0), "a_std": alla.std(0).clip(1e-2)}
        self._handles = {}

    def __len__(self):
        return len(self.index)

    def _image(self, e, t):
        if e not in self._handles:  # one handle per worker process
            self._handles[e] = h5py.File(self.files[e], "r")
        return self._handles[e][f"observations/images/{self.camera}"][t]

    def __getitem__(self, i):
        e, t = self.index[i]
        act = self.action[e][t:t + self.chunk]
        n = len(act)
        act = np.concatenate([act, np.repeat(act[-1:], self.chunk - n, 0)]) if n < self.chunk else act
        s = self.stats
        return {
            "qpos": torch.from_numpy((self.qpos[e][t] - s["q_mean"]) / s["q_std"]),
            "image": torch.from_numpy(self._image(e, t)).permute(2, 0, 1).float() / 255.0,
            "action": torch.from_numpy((act - s["a_mean"]) / s["a_std"]),
            "is_pad": torch.arange(self.chunk) >= n,
        }


class ACT(nn.Module):
    def __init__(self, m, qdim=14, adim=14, n_img_tokens=300):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(512, m.dim, 1)
        self.transformer = nn.Transformer(m.dim, m.heads, m.enc_layers, m.dec_layers, m.ff, 0.1, batch_first=True)
        self.vae = nn.TransformerEncoder(nn.TransformerEncoderLayer(m.dim, m.heads, m.ff, 0.1, batch_first=True), 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, m.dim))
        self.vae_q = nn.Linear(qdim, m.dim)
        self.vae_a = nn.Linear(adim, m.dim)
        self.vae_pos = nn.Parameter(torch.randn(1, 2 + m.chunk, m.dim) * 0.02)
        self.to_latent = nn.Linear(m.dim, 2 * m.latent)
        self.from_latent = nn.Linear(m.latent, m.dim)
        self.q_in = nn.Linear(qdim, m.dim)
        self.src_pos = nn.Parameter(torch.randn(1, 2 + n_img_tokens, m.dim) * 0.02)
        self.queries = nn.Parameter(torch.randn(1, m.chunk, m.dim) * 0.02)
        self.head = nn.Linear(m.dim, adim)
        self.latent = m.latent
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, qpos, image, action=None, is_pad=None):
        B = qpos.shape[0]
        if action is not None:
            tok = torch.cat([self.cls.expand(B, -1, -1), self.vae_q(qpos)[:, None], self.vae_a(action)], 1)
            mask = F.pad(is_pad, (2, 0), value=False)
            mu, logvar = self.to_latent(self.vae(tok + self.vae_pos, src_key_padding_mask=mask)[:, 0]).chunk(2, -1)
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        else:
            mu = logvar = None
            z = qpos.new_zeros(B, self.latent)
        img = self.proj(self.backbone((image - self.mean) / self.std)).flatten(2).transpose(1, 2)
        src = torch.cat([self.from_latent(z)[:, None], self.q_in(qpos)[:, None], img], 1) + self.src_pos
        return self.head(self.transformer(src, self.queries.expand(B, -1, -1))), mu, logvar


@torch.no_grad()
def sharded_rollouts(model, stats, cfg, device, rank, world_size):
    """Each rank runs its share of the evaluation episodes; per-episode returns are gathered on all ranks."""
    env = gym.make(cfg.task, obs_type="pixels_agent_pos", max_episode_steps=cfg.eval.max_steps)
    t = lambda x: torch.as_tensor(x, device=device, dtype=torch.float32)
    q_mean, q_std, a_mean, a_std = t(stats["q_mean"]), t(stats["q_std"]), t(stats["a_mean"]), t(stats["a_std"])
    model.eval()
    ep_returns = []
    for ep in range(rank, cfg.eval.n_episodes, world_size):
        obs, _ = env.reset(seed=1_000_000 + ep)
        best, step, done = 0.0, 0, False
        while not done:
            q = ((t(obs["agent_pos"]) - q_mean) / q_std)[None]
            img = t(obs["pixels"][cfg.data.camera]).permute(2, 0, 1)[None] / 255.0
            chunk = (model(q, img)[0][0] * a_std + a_mean).cpu().numpy()
            for a in chunk:
                obs, r, term, trunc, _ = env.step(a)
                best, step = max(best, r), step + 1
                done = term or trunc
                if done:
                    break
        ep_returns.append(best)
    env.close()
    model.train()
    mine = torch.tensor(ep_returns, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered)


def main():
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_cli())
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)

    files = sorted(glob.glob(os.path.join(cfg.data.dir, "episode_*.hdf5")))
    dataset = AlohaEpisodes(files, cfg.data.camera, cfg.model.chunk)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    per_gpu = cfg.train.global_batch // world_size
    loader = DataLoader(dataset, batch_size=per_gpu, sampler=sampler, num_workers=cfg.data.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = ACT(cfg.model).to(device)
    backbone = [p for n, p in model.named_parameters() if n.startswith("backbone.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": backbone, "lr": cfg.train.lr_backbone}],
                            lr=cfg.train.lr, weight_decay=cfg.train.wd)
    ddp_model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out, "config.yaml"))
        torch.save(dataset.stats, os.path.join(cfg.out, "stats.pt"))
        print(f"{len(files)} episodes, {len(dataset)} samples, {per_gpu} per GPU x {world_size}")

    for epoch in range(cfg.train.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        sums = torch.zeros(3, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            a_hat, mu, logvar = ddp_model(batch["qpos"], batch["image"], batch["action"], batch["is_pad"])
            valid = (~batch["is_pad"]).unsqueeze(-1)
            l1 = (F.l1_loss(a_hat, batch["action"], reduction="none") * valid).sum() / (valid.sum() * a_hat.shape[-1])
            kl = (-0.5 * (1 + logvar - mu ** 2 - logvar.exp())).sum(-1).mean()
            loss = l1 + cfg.train.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sums += torch.stack([l1.detach(), kl.detach(), torch.ones((), device=device)])
        dist.all_reduce(sums)
        if rank == 0:
            print(f"epoch {epoch}: l1 {sums[0] / sums[2]:.4f} kl {sums[1] / sums[2]:.4f} ({time.time() - tic:.0f}s)")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg.out, "last.pt"))

        if (epoch + 1) % cfg.eval.every == 0:
            returns = sharded_rollouts(model, dataset.stats, cfg, device, rank, world_size)
            if rank == 0:
                success = (returns >= 4).float().mean().item()
                print(f"epoch {epoch}: success {success:.2%}, mean max reward {returns.mean():.2f}")
                torch.save({"model": model.state_dict(), "epoch": epoch, "success": success},
                           os.path.join(cfg.out, f"epoch{epoch + 1}_success{success:.2f}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
