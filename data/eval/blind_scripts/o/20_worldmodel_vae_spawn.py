"""World Models, stage V: train the ConvVAE on frames from recorded CarRacing rollouts.

Rollouts were generated with generate_rollouts.py (one .npz per episode, obs uint8 64x64x3).
Multi-GPU through mp.spawn (one process per GPU):

    python 20_worldmodel_vae_spawn.py --config configs/vae_carracing.yaml
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image

DEFAULTS = {
    "rollout_dir": "/data/worldmodels/carracing_rollouts",
    "latent": 32,
    "batch_size": 128,
    "lr": 1e-4,
    "epochs": 20,
    "kl_tolerance": 0.5,
    "workers": 4,
    "log_every": 200,
    "out": "exp/vae",
    "master_port": 29533,
    "gpus": None,
}


class FrameDataset(Dataset):
    def __init__(self, files):
        # rollouts are small (1000 frames x 12KB), keep everything in RAM
        self.frames = np.concatenate([np.load(f)["obs"] for f in files])

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, i):
        return torch.from_numpy(self.frames[i]).permute(2, 0, 1).float() / 255.0


class ConvVAE(nn.Module):
    def __init__(self, z=32):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(3, 32, 4, 2), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 128, 4, 2), nn.ReLU(), nn.Conv2d(128, 256, 4, 2), nn.ReLU(), nn.Flatten())
        self.mu = nn.Linear(1024, z)
        self.logvar = nn.Linear(1024, z)
        self.fc = nn.Linear(z, 1024)
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(1024, 128, 5, 2), nn.ReLU(), nn.ConvTranspose2d(128, 64, 5, 2), nn.ReLU(),
            nn.ConvTranspose2d(64, 32, 6, 2), nn.ReLU(), nn.ConvTranspose2d(32, 3, 6, 2), nn.Sigmoid())

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = self.dec(self.fc(z).view(-1, 1024, 1, 1))
        return recon, mu, logvar


def vae_loss(recon, x, mu, logvar, z_dim, kl_tol):
    r = F.mse_loss(recon, x, reduction="none").sum(dim=(1, 2, 3)).mean()
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
    kl = torch.clamp(kl, min=kl_tol * z_dim).mean()
    return r + kl, r, kl


def main_worker(gpu, cfg):
    world = cfg["gpus"]
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(cfg["master_port"]))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", rank=gpu, world_size=world)
    device = torch.device("cuda", gpu)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(cfg["rollout_dir"], "*.npz")))
    n_val = max(1, len(files) // 20)
    train_ds, val_ds = FrameDataset(files[n_val:]), FrameDataset(files[:n_val])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=gpu, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(gpu, len(val_ds), world)),
                            batch_size=256, num_workers=2)

    model = DDP(ConvVAE(cfg["latent"]).to(device), device_ids=[gpu])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])

    if gpu == 0:
        os.makedirs(cfg["out"], exist_ok=True)
        print(f"{len(files)} rollouts, {len(train_ds)} train frames, {world} GPUs", flush=True)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            recon, mu, logvar = model(x)
            loss, r, kl = vae_loss(recon, x, mu, logvar, cfg["latent"], cfg["kl_tolerance"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if gpu == 0 and it % cfg["log_every"] == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.2f} rec {r.item():.2f} "
                      f"kl {kl.item():.2f}", flush=True)

        net = model.module.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for x in val_loader:
                x = x.to(device)
                recon, mu, logvar = net(x)
                loss, _, _ = vae_loss(recon, x, mu, logvar, cfg["latent"], cfg["kl_tolerance"])
                tot += torch.stack([loss * x.shape[0], torch.tensor(float(x.shape[0]), device=device)])
        dist.all_reduce(tot)
        if gpu == 0:
            print(f"epoch {epoch} val loss {(tot[0] / tot[1]).item():.2f} ({time.time() - t0:.0f}s)", flush=True)
            save_image(torch.cat([x[:8], recon[:8]]), os.path.join(cfg["out"], f"recon_{epoch}.png"), nrow=8)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(cfg["out"], "vae_best.pt" if epoch == cfg["epochs"] - 1 else "vae_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    if not cfg["gpus"]:
        cfg["gpus"] = torch.cuda.device_count()
    return cfg


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = load_config(ap.parse_args().config)
    mp.spawn(main_worker, args=(cfg), nprocs=cfg["gpus"], join=True)
