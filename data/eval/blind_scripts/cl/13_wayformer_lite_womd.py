"""Wayformer-lite (early fusion, latent query encoder) on Waymo Open Motion scenarios.

Scenarios are pre-extracted from the TFRecords into one pickle each (scenario-centric frame
at the current timestep); up to 8 `tracks_to_predict` per scenario.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        13_wayformer_lite_womd.py --data /lustre/womd/processed --out /lustre/exp/wayformer_lite
"""
import argparse
import glob
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

T_PAST, T_FUT, MODES = 11, 80, 6
MAX_AGENTS, MAX_PRED, MAX_RG = 64, 8, 512


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/lustre/womd/processed")
    p.add_argument("--out", default="/lustre/exp/wayformer_lite")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--latents", type=int, default=64)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4, help="at global batch 128")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class WOMDScenarios(Dataset):
    def __init__(self, root, split):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.pkl")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            s = pickle.load(f)
        return {
            "agents": torch.from_numpy(s["agent_past"][:MAX_AGENTS]).float(),      # (A, 11, 10) x y z l w h yaw vx vy valid
            "rg": torch.from_numpy(s["roadgraph"][:MAX_RG]).float(),               # (R, 7) x y dx dy type valid id
            "pred_idx": torch.from_numpy(s["tracks_to_predict"][:MAX_PRED]).long(),
            "fut": torch.from_numpy(s["agent_future"][s["tracks_to_predict"][:MAX_PRED]]).float(),  # (P, 80, 3) x y valid
        }


def collate(batch):
    B = len(batch)
    A = max(b["agents"].shape[0] for b in batch)
    R = max(b["rg"].shape[0] for b in batch)
    P = max(b["pred_idx"].shape[0] for b in batch)
    out = {"agents": torch.zeros(B, A, T_PAST, 10), "rg": torch.zeros(B, R, 7),
           "pred_idx": torch.zeros(B, P, dtype=torch.long), "fut": torch.zeros(B, P, T_FUT, 3),
           "pred_mask": torch.zeros(B, P, dtype=torch.bool)}
    for i, b in enumerate(batch):
        out["agents"][i, : b["agents"].shape[0]] = b["agents"]
        out["rg"][i, : b["rg"].shape[0]] = b["rg"]
        n = b["pred_idx"].shape[0]
        out["pred_idx"][i, :n] = b["pred_idx"]
        out["fut"][i, :n] = b["fut"]
        out["pred_mask"][i, :n] = True
    return out


class WayformerLite(nn.Module):
    def __init__(self, d=256, latents=64):
        super().__init__()
        self.agent_in = nn.Linear(10, d)
        self.rg_in = nn.Linear(7, d)
        self.time_emb = nn.Parameter(torch.randn(T_PAST, d) * 0.02)
        self.latent = nn.Parameter(torch.randn(latents, d) * 0.02)
        self.cross = nn.MultiheadAttention(d, 8, batch_first=True)
        self.self_blocks = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True), num_layers=4)
        self.mode_q = nn.Parameter(torch.randn(MODES, d) * 0.02)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True), num_layers=2)
        self.traj = nn.Linear(d, T_FUT * 2)
        self.score = nn.Linear(d, 1)

    def forward(self, agents, rg, pred_idx):
        B, A, T, _ = agents.shape
        a_valid = agents[..., -1] > 0
        a_tok = (self.agent_in(agents) + self.time_emb).flatten(1, 2)
        r_tok = self.rg_in(rg)
        tokens = torch.cat([a_tok, r_tok], 1)
        pad = ~torch.cat([a_valid.flatten(1), rg[..., 5] > 0], 1)
        lat, _ = self.cross(self.latent.expand(B, -1, -1), tokens, tokens, key_padding_mask=pad)
        lat = self.self_blocks(lat)
        agent_last = a_tok.view(B, A, T, -1)[:, :, -1]
        q_agent = agent_last.gather(1, pred_idx[..., None].expand(-1, -1, agent_last.shape[-1]))  # (B, P, d)
        P = q_agent.shape[1]
        q = (q_agent[:, :, None] + self.mode_q).flatten(1, 2)  # (B, P*K, d)
        h = self.decoder(q, lat).view(B, P, MODES, -1)
        return self.traj(h).view(B, P, MODES, T_FUT, 2), self.score(h).squeeze(-1)


def loss_fn(trajs, scores, fut, mask):
    trajs, scores, fut = trajs[mask], scores[mask], fut[mask]
    valid = fut[..., 2] > 0
    d = torch.norm(trajs - fut[:, None, :, :2], dim=-1)
    ade = (d * valid[:, None]).sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    best = ade.argmin(-1)
    sel = trajs[torch.arange(len(best), device=best.device), best]
    reg = (F.smooth_l1_loss(sel, fut[..., :2], reduction="none").sum(-1) * valid).sum() / valid.sum()
    return reg + F.cross_entropy(scores, best)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = WOMDScenarios(args.data, "training")
    val_ds = WOMDScenarios(args.data, "validation")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, collate_fn=collate, num_workers=args.workers,
                          pin_memory=True, drop_last=True, prefetch_factor=4)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.bs,
                        collate_fn=collate, num_workers=args.workers)

    net = WayformerLite(args.d, args.latents).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.bs * world / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.02)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            # tracks whose last future step is unobserved cannot be scored
            b["pred_mask"] &= b["fut"][:, :, -1, 2] > 0
            if not b["pred_mask"].any():
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                trajs, scores = model(b["agents"], b["rg"], b["pred_idx"])
            loss = loss_fn(trajs.float(), scores.float(), b["fut"], b["pred_mask"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 200 == 0 and rank == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss(rank0) {loss.item():.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        net.eval()
        acc = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for b in val_dl:
                b = {k: v.to(device) for k, v in b.items()}
                trajs, _ = net(b["agents"], b["rg"], b["pred_idx"])
                m = b["pred_mask"] & (b["fut"][:, :, -1, 2] > 0)
                err = torch.norm(trajs[m] - b["fut"][m][:, None, :, :2], dim=-1)
                acc[0] += err.mean(-1).min(-1).values.sum()
                acc[1] += err[..., -1].min(-1).values.sum()
                acc[2] += (err[..., -1].min(-1).values > 2.0).sum()
                acc[3] += m.sum()
        dist.all_reduce(acc)
        if rank == 0:
            n = acc[3].clamp(min=1)
            print(f"epoch {epoch}: minADE {acc[0] / n:.3f} minFDE {acc[1] / n:.3f} MR {acc[2] / n:.3f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
