"""One transformer trunk with separate 6 h and 24 h output heads (Pangu-style hierarchical
temporal aggregation at inference: as many 24 h steps as possible, then 6 h steps).

Each training step uses one head, picked from a generator seeded by the global step.

    torchrun --nproc_per_node=8 15_multilead_heads.py --data /shared/era5/1.40625deg \
        --init /shared/runs/trunk_6h/best.pt --out /shared/runs/multilead
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class LeadPairs(Dataset):
    """6-hourly memmap per year, (T, C, 128, 256). Returns x_t, x_{t+6h}, x_{t+24h}."""

    def __init__(self, root, years, mean, std):
        self.a = [np.load(f"{root}/{y}.npy", mmap_mode="r") for y in years]
        self.items = [(k, t) for k, arr in enumerate(self.a) for t in range(arr.shape[0] - 4)]
        self.mean, self.std = mean[:, None, None], std[:, None, None]

    def __len__(self):
        return len(self.items)

    def _n(self, v):
        return torch.from_numpy((np.asarray(v, dtype=np.float32) - self.mean) / self.std)

    def __getitem__(self, i):
        k, t = self.items[i]
        a = self.a[k]
        return self._n(a[t]), self._n(a[t + 1]), self._n(a[t + 4])


class EvalInits(Dataset):
    """00 UTC initialisations with the verifying state `hours` later."""

    def __init__(self, root, year, hours, mean, std):
        self.a = np.load(f"{root}/{year}.npy", mmap_mode="r")
        self.steps = hours // 6
        self.inits = [t for t in range(0, self.a.shape[0] - self.steps, 4)]
        self.mean, self.std = mean[:, None, None], std[:, None, None]

    def __len__(self):
        return len(self.inits)

    def __getitem__(self, i):
        t = self.inits[i]
        x = (np.asarray(self.a[t], dtype=np.float32) - self.mean) / self.std
        y = (np.asarray(self.a[t + self.steps], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(y)


class Trunk(nn.Module):
    def __init__(self, ch, dim, depth, heads, patch, grid):
        super().__init__()
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, grid[0] * grid[1], dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        return self.norm(self.enc(self.embed(x).flatten(2).transpose(1, 2) + self.pos))


class MultiLead(nn.Module):
    def __init__(self, ch=69, img=(128, 256), patch=4, dim=768, depth=12, heads=12):
        super().__init__()
        self.ch, self.p = ch, patch
        self.grid = (img[0] // patch, img[1] // patch)
        self.trunk = Trunk(ch, dim, depth, heads, patch, self.grid)
        self.heads = nn.ModuleDict({"6": nn.Linear(dim, ch * patch * patch),
                                    "24": nn.Linear(dim, ch * patch * patch)})

    def forward(self, x, lead="6"):
        B = x.shape[0]
        h = self.heads[lead](self.trunk(x))
        gh, gw = self.grid
        h = h.view(B, gh, gw, self.ch, self.p, self.p).permute(0, 3, 1, 4, 2, 5)
        return x + h.reshape_as(x)

    @torch.no_grad()
    def forecast(self, x, hours):
        for _ in range(hours // 24):
            x = self(x, "24")
        for _ in range((hours % 24) // 6):
            x = self(x, "6")
        return x


def lat_w(device, n=128):
    lat = 90.0 - (torch.arange(n, device=device) + 0.5) * 180.0 / n
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4, help="for the 8 x 4 reference batch")
    ap.add_argument("--p24", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--eval-hours", type=int, nargs="+", default=[24, 72, 120])
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = np.load(f"{args.data}/normalize_1979_2015.npz")
    mean, std = norm["mean"].astype(np.float32), norm["std"].astype(np.float32)
    train_ds = LeadPairs(args.data, range(1979, 2016), mean, std)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_loaders = {}
    for h in args.eval_hours:
        full = EvalInits(args.data, 2017, h, mean, std)
        val_loaders[h] = DataLoader(Subset(full, range(rank, len(full), world)), batch_size=args.batch,
                                    num_workers=2, pin_memory=True)

    net = MultiLead(ch=len(mean))
    if args.init:
        sd = torch.load(args.init, map_location="cpu")["model"]
        # the 6 h run was saved from the DDP wrapper; its head becomes heads.6
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        sd = {("heads.6." + k[len("head."):] if k.startswith("head.") else k): v for k, v in sd.items()}
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print("init from", args.init, "missing:", missing, "unexpected:", unexpected)
    net.to(device)
    # only one of the two heads takes part in each step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * world * args.batch / 32
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    w = lat_w(device)
    std_t = torch.from_numpy(std).to(device).view(1, -1, 1, 1)
    z500 = 11
    pick = torch.Generator()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y6, y24 in train_dl:
            pick.manual_seed(args.seed * 1_000_003 + step)
            lead = "24" if torch.rand(1, generator=pick).item() < args.p24 else "6"
            x = x.to(device, non_blocking=True)
            y = (y24 if lead == "24" else y6).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, lead)
            loss = ((pred.float() - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} lead {lead}h loss {loss.item():.4f} "
                      f"({(time.time() - t0) / 100:.2f}s/it)", flush=True)
                t0 = time.time()

        model.module.eval()
        res = torch.zeros(len(args.eval_hours), 2, dtype=torch.float64, device=device)
        for j, h in enumerate(args.eval_hours):
            for x, y in val_loaders[h]:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module.forecast(x, h).float()
                r = ((((pred - y) * std_t) ** 2) * w).mean(dim=(-2, -1)).sqrt()
                res[j, 0] += r[:, z500].sum().double()
                res[j, 1] += x.shape[0]
        dist.all_reduce(res)
        if rank == 0:
            print(f"epoch {epoch} z500 RMSE " + ", ".join(
                f"{h}h={(res[j, 0] / res[j, 1]).item():.1f}" for j, h in enumerate(args.eval_hours)), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
