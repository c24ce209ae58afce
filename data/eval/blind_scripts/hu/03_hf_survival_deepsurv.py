#!/usr/bin/env python
"""DeepSurv-style time-to-event model for heart-failure patients (multi-site).

Trains on the development sites and reports Harrell's C-index on the internal
validation split and on the held-out external site.

    # 2 nodes x 4 GPUs
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_HOST:29500 --rdzv_id=hf-surv \
        03_hf_survival_deepsurv.py --data_dir /shared/cohorts/hf_v3 --ckpt_dir /shared/runs/hf_deepsurv
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from lifelines.utils import concordance_index
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:
    import wandb
except ImportError:  # logging is optional
    wandb = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--dev_sites", default="site_a,site_b,site_c")
    p.add_argument("--external_site", default="site_d")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256, 128])
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wandb_project", default=None)
    return p.parse_args()


def load_site(data_dir, site, split):
    d = np.load(os.path.join(data_dir, site, f"{split}.npz"))
    # x: standardized features (labs carried forward + missingness indicators + demographics)
    return (torch.from_numpy(d["x"]).float(),
            torch.from_numpy(d["time"]).float(),
            torch.from_numpy(d["event"]).float())


def load_sites(data_dir, sites, split):
    parts = [load_site(data_dir, s, split) for s in sites]
    return tuple(torch.cat(t) for t in zip(*parts))


class DeepSurv(nn.Module):
    def __init__(self, in_dim, hidden, dropout):
        super().__init__()
        layers, d = [], in_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.SELU(), nn.AlphaDropout(dropout)]
            d = h
        self.body = nn.Sequential(*layers)
        self.risk = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.risk(self.body(x)).squeeze(-1)


def cox_ph_loss(risk, time, event):
    """Negative Breslow partial log-likelihood over the risk sets in this batch."""
    order = torch.argsort(time, descending=True)
    risk, event = risk[order], event[order]
    log_cum = torch.logcumsumexp(risk, dim=0)
    n_events = event.sum().clamp(min=1.0)
    return -((risk - log_cum) * event).sum() / n_events


@torch.no_grad()
def gather_risk(model, x, device, rank, world):
    """Each rank scores a disjoint slice; slices can differ in length by one."""
    model.eval()
    idx = torch.arange(rank, x.size(0), world)
    local = torch.cat([model(x[i].to(device)) for i in idx.split(4096)]) if len(idx) else \
        torch.empty(0, device=device)
    n_local = torch.tensor([local.numel()], device=device)
    sizes = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(sizes, n_local)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, device=device)
    padded[: local.numel()] = local
    bufs = [torch.zeros(max_n, device=device) for _ in range(world)]
    dist.all_gather(bufs, padded)
    risk = torch.empty(x.size(0))
    for r, (buf, n) in enumerate(zip(bufs, sizes)):
        risk[r::world] = buf[: int(n.item())].cpu()
    return risk.numpy()


def c_index(risk, time, event):
    # lifelines expects higher score = longer survival
    return concordance_index(time.numpy(), -risk, event.numpy())


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    # different dropout masks per rank; weights are synced by DDP from rank 0
    torch.manual_seed(args.seed + rank)

    dev_sites = args.dev_sites.split(",")
    x_tr, t_tr, e_tr = load_sites(args.data_dir, dev_sites, "train")
    x_va, t_va, e_va = load_sites(args.data_dir, dev_sites, "val")
    x_ext, t_ext, e_ext = load_site(args.data_dir, args.external_site, "all")

    train_ds = TensorDataset(x_tr, t_tr, e_tr)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=2, pin_memory=True, drop_last=True)

    model = DeepSurv(x_tr.size(1), args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    run = None
    if rank == 0 and wandb is not None and args.wandb_project:
        run = wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for xb, tb, eb in loader:
            xb, tb, eb = xb.to(device, non_blocking=True), tb.to(device), eb.to(device)
            loss = cox_ph_loss(model(xb), tb, eb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        risk_va = gather_risk(model.module, x_va, device, rank, world)
        cidx = c_index(risk_va, t_va, e_va)  # identical on every rank
        sched.step(cidx)

        if rank == 0:
            print(f"[{epoch:03d}] loss={train_loss:.4f} val_cindex={cidx:.4f} "
                  f"lr={opt.param_groups[0]['lr']:.2e} {time.time() - t0:.1f}s", flush=True)
            if run is not None:
                run.log({"train/loss": train_loss, "val/c_index": cidx}, step=epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": max(best, cidx)}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if cidx > best:
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best_model.pt"))
        best = max(best, cidx)
        dist.barrier()

    # external validation with the best weights
    state = torch.load(os.path.join(args.ckpt_dir, "best_model.pt"), map_location="cpu")
    model.module.load_state_dict(state)
    risk_ext = gather_risk(model.module, x_ext, device, rank, world)
    if rank == 0:
        ext = c_index(risk_ext, t_ext, e_ext)
        print(f"external site {args.external_site}: C-index {ext:.4f} (n={len(t_ext)})", flush=True)
        if run is not None:
            run.summary["external/c_index"] = ext
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
