"""ClimaX-style variable-tokenized transformer, fine-tuned for 6-72 h forecasting at 1.40625 deg.

Resumable: pass --resume path/to/last.ckpt after a preemption.

    torchrun --nproc_per_node=8 08_climax_leadtime_resume.py --cfg configs/climax_ft.yaml
    torchrun --nproc_per_node=8 08_climax_leadtime_resume.py --cfg configs/climax_ft.yaml --resume runs/climax_ft/last.ckpt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LEAD_HOURS = [6, 12, 24, 48, 72]


class ShardedNpz(Dataset):
    """Monthly .npy shards (T, V, 128, 256) at hourly resolution."""

    def __init__(self, root, years, mean, std, lead_hours):
        self.shards = []
        for y in years:
            for m in range(1, 13):
                p = os.path.join(root, f"{y}", f"{y}-{m:02d}.npy")
                if os.path.exists(p):
                    self.shards.append(np.load(p, mmap_mode="r"))
        self.max_lead = max(lead_hours)
        self.leads = lead_hours
        self.index = [(s, t) for s, a in enumerate(self.shards) for t in range(0, a.shape[0], 6)]
        self.flat = np.cumsum([0] + [a.shape[0] for a in self.shards])
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self.index = [(s, t) for s, t in self.index if self.flat[s] + t + self.max_lead < self.flat[-1]]

    def _get(self, g):
        s = int(np.searchsorted(self.flat, g, side="right") - 1)
        return np.asarray(self.shards[s][g - self.flat[s]], dtype=np.float32)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        lead = self.leads[int(torch.randint(len(self.leads), ()))]
        g = int(self.flat[s]) + t
        x = (self._get(g) - self.mean) / self.std
        y = (self._get(g + lead) - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(y), torch.tensor(lead / 100.0, dtype=torch.float32)


class VarAggregation(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, dim))
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        # x: (B, V, L, D) -> (B, L, D)
        B, V, L, D = x.shape
        x = x.permute(0, 2, 1, 3).reshape(B * L, V, D)
        q = self.query.expand(B * L, -1, -1)
        out = self.attn(q, x, x, need_weights=False)[0]
        return out.view(B, L, D)


class ClimaXLike(nn.Module):
    def __init__(self, n_vars, img=(128, 256), patch=4, dim=1024, depth=8, heads=16):
        super().__init__()
        self.n_vars, self.patch = n_vars, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.var_embed = nn.ModuleList([nn.Conv2d(1, dim, patch, patch) for _ in range(n_vars)])
        self.var_id = nn.Parameter(torch.zeros(1, n_vars, 1, dim))
        self.agg = VarAggregation(dim, heads)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.lead = nn.Linear(1, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, n_vars * patch * patch))
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.var_id, std=0.02)

    def forward(self, x, lead):
        B, V, H, W = x.shape
        toks = torch.stack([self.var_embed[v](x[:, v:v + 1]).flatten(2).transpose(1, 2)
                            for v in range(V)], dim=1)
        h = self.agg(toks + self.var_id) + self.pos + self.lead(lead[:, None]).unsqueeze(1)
        h = self.norm(self.encoder(h))
        out = self.head(h).view(B, self.gh, self.gw, V, self.patch, self.patch)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(B, V, H, W)


def lat_weights(device, n=128):
    lat = np.linspace(-87.8638, 87.8638, n)
    w = np.cos(np.deg2rad(lat))
    return torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


@torch.no_grad()
def evaluate(net, loader, w, std, device):
    net.eval()
    sums = torch.zeros(len(LEAD_HOURS), std.shape[1], dtype=torch.float64, device=device)
    cnt = torch.zeros(len(LEAD_HOURS), dtype=torch.float64, device=device)
    for x, y, lead in loader:
        x, y, lead = x.to(device), y.to(device), lead.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x, lead)
        rmse = ((((pred.float() - y) * std) ** 2) * w).mean(dim=(-2, -1)).sqrt().double()
        li = torch.round(lead * 100).long()
        for k, h in enumerate(LEAD_HOURS):
            m = li == h
            sums[k] += rmse[m].sum(0)
            cnt[k] += m.sum()
    dist.all_reduce(sums)
    dist.all_reduce(cnt)
    net.train()
    return sums / cnt.clamp_min(1)[:, None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = np.load(cfg["stats_file"])
    mean, std = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)
    train_ds = ShardedNpz(cfg["root"], range(1979, 2016), mean, std, LEAD_HOURS)
    val_full = ShardedNpz(cfg["root"], [2016], mean, std, LEAD_HOURS)
    val_ds = Subset(val_full, list(range(rank, len(val_full), world)))

    bs = cfg["global_batch"] // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=cfg["seed"])
    train_dl = DataLoader(train_ds, bs, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, bs, num_workers=4, pin_memory=True)

    net = ClimaXLike(len(mean), dim=cfg["dim"], depth=cfg["depth"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"], betas=(0.9, 0.99), weight_decay=1e-5)
    total = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    scaler_std = torch.from_numpy(std).to(device).view(1, -1, 1, 1)
    w = lat_weights(device)

    start_epoch = 0
    best = float("inf")
    if args.resume:
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["lr_scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        del ckpt
    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"world={world} per-gpu batch={bs} start_epoch={start_epoch}", flush=True)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, lead) in enumerate(train_dl):
            x, y, lead = (t.to(device, non_blocking=True) for t in (x, y, lead))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, lead)
            loss = ((pred.float() - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        rmse = evaluate(net, val_dl, w, scaler_std, device)
        z500 = cfg["variables"].index("z500")
        score = rmse[LEAD_HOURS.index(72), z500].item()
        if rank == 0:
            for k, h in enumerate(LEAD_HOURS):
                print(f"  val +{h}h z500 {rmse[k, z500]:.1f}", flush=True)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)
            ckpt = {"state_dict": net.state_dict(), "optimizer": opt.state_dict(),
                    "lr_scheduler": sched.state_dict(), "epoch": epoch, "best": min(best, score)}
            torch.save(ckpt, os.path.join(out_dir, "last.ckpt"))
            if score < best:
                torch.save(ckpt, os.path.join(out_dir, "best.ckpt"))
        best = min(best, score)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
