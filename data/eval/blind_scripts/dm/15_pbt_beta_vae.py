"""Population-based training of a convolutional beta-VAE on MNIST.

Members explore the learning rate and the KL weight ``beta``; they are ranked
by validation ELBO (a beta-independent score, so members are comparable).
Scores are exchanged with a single all_reduce over a world-sized vector.

    torchrun --nproc_per_node=4 pbt_vae.py --epochs 40 --out runs/pbt_vae
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split
from torchvision import datasets, transforms
from torchvision.utils import save_image


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/pbt_vae")
    p.add_argument("--latent", type=int, default=16)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class VAE(nn.Module):
    def __init__(self, z):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(1, 32, 4, 2, 1), nn.ReLU(),
            nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * 7 * 7, 256), nn.ReLU())
        self.mu = nn.Linear(256, z)
        self.logvar = nn.Linear(256, z)
        self.dec = nn.Sequential(
            nn.Linear(z, 256), nn.ReLU(), nn.Linear(256, 64 * 7 * 7), nn.ReLU(),
            nn.Unflatten(1, (64, 7, 7)),
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(),
            nn.ConvTranspose2d(32, 1, 4, 2, 1))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        zs = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(zs), mu, logvar


def vae_terms(x, logits, mu, logvar):
    rec = F.binary_cross_entropy_with_logits(logits, x, reduction="none").flatten(1).sum(1)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
    return rec, kl


@torch.no_grad()
def val_elbo(model, loader, device):
    model.eval()
    tot, n = 0.0, 0
    for x, _ in loader:
        x = x.to(device)
        logits, mu, logvar = model(x)
        rec, kl = vae_terms(x, logits, mu, logvar)
        tot += (rec + kl).sum().item()
        n += x.size(0)
    model.train()
    return -tot / n


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl")
    device = torch.device(f"cuda:{local_rank}")

    rng = random.Random(args.seed + 101 * rank)
    torch.manual_seed(args.seed + 101 * rank)
    hp = {"lr": 10 ** rng.uniform(-4, -2.5), "beta": rng.uniform(0.5, 4.0)}

    tf = transforms.ToTensor()
    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        os.makedirs(os.path.join(args.out, "pop"), exist_ok=True)
    dist.barrier()
    full = datasets.MNIST(args.data, train=True, transform=tf)
    train_set, val_set = random_split(full, [55000, 5000], generator=torch.Generator().manual_seed(0))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1000, num_workers=2)

    model = VAE(args.latent).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    records = []

    for epoch in range(1, args.epochs + 1):
        for x, _ in train_loader:
            x = x.to(device, non_blocking=True)
            logits, mu, logvar = model(x)
            rec, kl = vae_terms(x, logits, mu, logvar)
            loss = (rec + hp["beta"] * kl).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        elbo = val_elbo(model, val_loader, device)
        records.append({"epoch": epoch, "elbo": elbo, **hp})
        print(f"[member {rank}] epoch {epoch:02d} elbo {elbo:.2f} beta {hp['beta']:.2f} "
              f"lr {hp['lr']:.2e}", flush=True)

        scores = torch.zeros(world).cuda()
        scores[rank] = elbo
        dist.all_reduce(scores, op=dist.ReduceOp.SUM)
        scores = scores.tolist()

        if epoch % args.every == 0 and epoch != args.epochs:
            ranked = sorted(range(world), key=lambda r: scores[r], reverse=True)
            cut = max(1, world // 4)
            top, bottom = ranked[:cut], ranked[-cut:]
            path = lambda r: os.path.join(args.out, "pop", f"member_{r}.pt")
            if rank in top:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hp": hp}, path(rank))
            dist.barrier()
            if rank in bottom:
                donor = rng.choice(top)
                ck = torch.load(path(donor), map_location=device)
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
                hp = {"lr": ck["hp"]["lr"] * rng.choice([0.8, 1.2]),
                      "beta": max(0.1, ck["hp"]["beta"] * rng.choice([0.8, 1.2]))}
                for g in opt.param_groups:
                    g["lr"] = hp["lr"]
                print(f"[member {rank}] copied member {donor} (elbo {scores[donor]:.2f})", flush=True)
            dist.barrier()

    best = max(range(world), key=lambda r: scores[r])
    if rank == best:
        torch.save({"model": model.state_dict(), "hp": hp, "elbo": scores[best], "records": records},
                   os.path.join(args.out, "best.pt"))
        with torch.no_grad():
            samples = torch.sigmoid(model.dec(torch.randn(64, args.latent, device=device)))
        save_image(samples, os.path.join(args.out, "best_samples.png"), nrow=8)
    if rank == 0:
        with open(os.path.join(args.out, "final_scores.json"), "w") as f:
            json.dump({"elbo": scores, "best": best}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
