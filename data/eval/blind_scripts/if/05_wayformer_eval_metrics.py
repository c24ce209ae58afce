"""Wayformer (early fusion, latent-query encoder) on Waymo Open Motion.

Validation reports minADE / minFDE / miss rate / overlap over the whole val split.

    torchrun --nproc_per_node=8 05_wayformer_eval_metrics.py --data /mnt/womd/scenario_tensors \
        --run-name wayformer_ef_l16
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST, FUT = 11, 80
MISS_THRESH = {30: 1.0, 50: 1.8, 80: 3.0}  # lateral-ish distance thresholds per horizon (simplified)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-name", default="wayformer")
    p.add_argument("--out", default="/mnt/experiments/wayformer")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--latents", type=int, default=192)
    p.add_argument("--modes", type=int, default=6)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class ScenarioTensors(Dataset):
    """One .pt file per scenario produced by the offline converter (already padded)."""

    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.items = [os.path.join(root, split, line.strip()) for line in f if line.strip()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.load(self.items[i])


class WayformerEF(nn.Module):
    def __init__(self, d, latents, layers, modes):
        super().__init__()
        self.modes = modes
        self.agent_proj = nn.Linear(HIST * 8, d)
        self.road_proj = nn.Linear(20 * 5, d)
        self.light_proj = nn.Linear(HIST * 3, d)
        self.modality = nn.Parameter(torch.zeros(3, d))
        self.latent = nn.Parameter(torch.randn(latents, d) * 0.02)
        self.cross = nn.MultiheadAttention(d, 8, batch_first=True)
        self.cross_norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.self_attn = nn.TransformerEncoder(layer, layers)
        self.mode_q = nn.Parameter(torch.randn(modes, d) * 0.02)
        dec_layer = nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, 2)
        self.traj = nn.Linear(d, FUT * 4)  # mu_x, mu_y, log_b_x, log_b_y (Laplace)
        self.score = nn.Linear(d, 1)

    def forward(self, x):
        B = x["agents"].shape[0]
        tok = torch.cat([
            self.agent_proj(x["agents"].flatten(2)) + self.modality[0],
            self.road_proj(x["roads"].flatten(2)) + self.modality[1],
            self.light_proj(x["lights"].flatten(2)) + self.modality[2],
        ], 1)
        pad = ~torch.cat([x["agents_mask"], x["roads_mask"], x["lights_mask"]], 1)
        lat = self.latent[None].expand(B, -1, -1)
        lat = self.cross_norm(lat + self.cross(lat, tok, tok, key_padding_mask=pad)[0])
        mem = self.self_attn(lat)
        q = self.mode_q[None].expand(B, -1, -1)
        h = self.decoder(q, mem)
        out = self.traj(h).view(B, self.modes, FUT, 4)
        return out[..., :2], out[..., 2:].clamp(-5, 5), self.score(h).squeeze(-1)


def laplace_wta(mu, log_b, logits, gt, valid):
    vm = valid[:, None].float()
    ade = ((mu - gt[:, None]).norm(dim=-1) * vm).sum(-1) / vm.sum(-1).clamp(min=1)
    best = ade.argmin(-1)
    r = torch.arange(len(best), device=mu.device)
    nll = (torch.abs(gt - mu[r, best]) / log_b[r, best].exp() + log_b[r, best]).sum(-1)
    nll = (nll * valid).sum() / valid.sum().clamp(min=1)
    return nll + F.cross_entropy(logits, best), ade


def validate(model, loader, device):
    model.eval()
    ade_sum = fde_sum = miss = overlap = 0.0
    n = 0
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            mu, _, logits = model(batch)
            gt, gv = batch["target_future"], batch["target_future_valid"]
            err = (mu - gt[:, None]).norm(dim=-1)
            full = gv.all(-1)
            if not full.any():
                continue
            ade = err.mean(-1).min(-1).values[full]
            fde_all = err[..., -1]
            fde = fde_all.min(-1).values[full]
            ade_sum += ade.sum().item()
            fde_sum += fde.sum().item()
            miss += (fde > MISS_THRESH[80]).sum().item()
            # overlap of the most likely mode with any other agent's ground-truth future box centre
            top = mu[torch.arange(len(mu)), logits.argmax(-1)]
            others = batch["others_future"]  # [B, A, FUT, 2]
            d_min = (top[:, None] - others).norm(dim=-1).amin(dim=(1, 2))
            overlap += (d_min[full] < 1.0).sum().item()
            n += int(full.sum())
    totals = torch.tensor([ade_sum, fde_sum, miss, overlap, n], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    ade_sum, fde_sum, miss, overlap, n = totals.tolist()
    model.train()
    n = max(n, 1.0)
    return {"minADE": ade_sum / n, "minFDE": fde_sum / n, "MR": miss / n, "overlap": overlap / n}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    run_dir = os.path.join(args.out, args.run_name)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set = ScenarioTensors(args.data, "training")
    val_set = ScenarioTensors(args.data, "validation")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, prefetch_factor=4)
    val_loader = DataLoader(val_set, args.bs, sampler=val_sampler, num_workers=args.workers)

    model = WayformerEF(args.d, args.latents, args.layers, args.modes).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.bs / 128, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                mu, log_b, logits = model(batch)
            loss, _ = laplace_wta(mu.float(), log_b.float(), logits.float(),
                                  batch["target_future"], batch["target_future_valid"])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}:{it}] loss={loss.item():.4f} lr={sched.get_last_lr()[0]:.2e}", flush=True)

        metrics = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val {json.dumps(metrics)} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "metrics": metrics}
            torch.save(state, os.path.join(run_dir, "last.pt"))
            if metrics["minFDE"] < best:
                best = metrics["minFDE"]
                torch.save(state, os.path.join(run_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
