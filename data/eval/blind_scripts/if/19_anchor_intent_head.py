"""Intention-point goal classifier + goal-conditioned trajectory completion (DenseTNT / MTR-like)
on Waymo Open Motion. 64 k-means intention points per agent type are loaded from the cluster file.

    torchrun --nproc_per_node=8 19_anchor_intent_head.py --data /data/womd/mtr_processed \
        --intention-points /data/womd/cluster_64_center_dict.pkl --out /data/exp/intent_head
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TYPES = ("TYPE_VEHICLE", "TYPE_PEDESTRIAN", "TYPE_CYCLIST")
FUT = 80
NUM_INTENTIONS = 64
DEVICE = torch.device("cuda:0")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--intention-points", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--top-k", type=int, default=6)
    return p.parse_args()


def load_intention_points(path):
    with open(path, "rb") as f:
        centers = pickle.load(f)  # {"TYPE_VEHICLE": [64, 2], ...}
    return torch.stack([torch.from_numpy(np.asarray(centers[t])).float() for t in TYPES]).to(DEVICE)


class FocalAgentSamples(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}_focal_index.pkl"), "rb") as f:
            self.index = pickle.load(f)  # list of (file, track_index)
        self.dir = os.path.join(root, split)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        fname, track = self.index[i]
        d = np.load(os.path.join(self.dir, fname))
        key = str(track)
        return {
            "hist": torch.from_numpy(d[f"{key}/hist"].astype(np.float32)),  # [64, 11, 9] agent-centric
            "hist_mask": torch.from_numpy(d[f"{key}/hist_mask"]),  # [64]
            "map": torch.from_numpy(d[f"{key}/map"].astype(np.float32)),  # [768, 20, 9]
            "map_mask": torch.from_numpy(d[f"{key}/map_mask"]),  # [768]
            "fut": torch.from_numpy(d[f"{key}/fut"].astype(np.float32)),  # [80, 2]
            "fut_valid": torch.from_numpy(d[f"{key}/fut_valid"]),  # [80]
            "agent_type": torch.tensor(TYPES.index(str(d[f"{key}/type"])), dtype=torch.long),
        }


class IntentionNet(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.agent = nn.Sequential(nn.Linear(11 * 9, d), nn.ReLU(), nn.Linear(d, d))
        self.map = nn.Sequential(nn.Linear(9, d), nn.ReLU(), nn.Linear(d, d))
        enc_layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, 6)
        self.goal_embed = nn.Sequential(nn.Linear(2, d), nn.ReLU(), nn.Linear(d, d))
        self.goal_attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.goal_score = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 1))
        self.goal_offset = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2))
        self.completion = nn.Sequential(nn.Linear(2 * d + 2, d), nn.ReLU(), nn.Linear(d, FUT * 2))

    def encode(self, b):
        a = self.agent(b["hist"].flatten(2))
        m = self.map(b["map"]).max(2).values
        pad = ~torch.cat([b["hist_mask"], b["map_mask"]], 1)
        return self.encoder(torch.cat([a, m], 1), src_key_padding_mask=pad), pad

    def forward(self, b, intention_points, goals=None, top_k=6):
        x, pad = self.encode(b)
        focal = x[:, 0]
        pts = intention_points[b["agent_type"]]  # [B, 64, 2]
        q = self.goal_embed(pts) + focal[:, None]
        q = q + self.goal_attn(q, x, x, key_padding_mask=pad)[0]
        scores = self.goal_score(q).squeeze(-1)
        refined = pts + self.goal_offset(q)
        if goals is None:  # inference: complete the top-k goals
            top = scores.topk(top_k, -1).indices
            goals = refined.gather(1, top[..., None].expand(-1, -1, 2))
            goal_feat = q.gather(1, top[..., None].expand(-1, -1, q.shape[-1]))
        else:  # training: teacher-forced completion of the ground-truth goal
            goal_feat = self.goal_embed(goals)
        h = torch.cat([focal[:, None].expand(-1, goals.shape[1], -1), goal_feat, goals], -1)
        trajs = self.completion(h).view(-1, goals.shape[1], FUT, 2)
        return scores, refined, trajs


def compute_loss(model_out, b, intention_points):
    scores, refined, trajs = model_out
    valid = b["fut_valid"]
    last = valid.float().cumsum(-1).argmax(-1)  # last valid future step
    end = b["fut"][torch.arange(len(last)), last]  # [B, 2]
    pts = intention_points[b["agent_type"]]
    tgt = (pts - end[:, None]).norm(dim=-1).argmin(-1)
    cls = F.cross_entropy(scores, tgt)
    r = torch.arange(len(tgt), device=scores.device)
    offset = F.smooth_l1_loss(refined[r, tgt], end)
    comp = (F.smooth_l1_loss(trajs[:, 0], b["fut"], reduction="none").sum(-1) * valid).sum() / valid.sum().clamp(min=1)
    return cls + offset + comp


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    intention_points = load_intention_points(args.intention_points)
    train_ds, val_ds = FocalAgentSamples(args.data, "training"), FocalAgentSamples(args.data, "validation")
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=8, pin_memory=True,
                           drop_last=True)
    va_loader = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=8, pin_memory=True)

    model = DDP(IntentionNet().to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 80, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [22, 24, 26, 28], 0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, b in enumerate(tr_loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            last = b["fut_valid"].float().cumsum(-1).argmax(-1)
            gt_goal = b["fut"][torch.arange(len(last), device=device), last][:, None]
            out = model(b, intention_points, goals=gt_goal)
            loss = compute_loss(out, b, intention_points)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optim.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} iter {i} loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        m = torch.zeros(4, device=device)
        with torch.no_grad():
            for b in va_loader:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                _, _, trajs = model.module(b, intention_points, top_k=args.top_k)
                valid = b["fut_valid"]
                err = (trajs - b["fut"][:, None]).norm(dim=-1)
                ade = ((err * valid[:, None]).sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)).min(-1).values
                full = valid[:, -1]
                fde = err[..., -1].min(-1).values
                m += torch.stack([ade[full].sum(), fde[full].sum(), (fde[full] > 2.0).float().sum(),
                                  full.float().sum()])
        dist.all_reduce(m)
        if rank == 0:
            n = m[3].clamp(min=1)
            print(f"epoch {epoch}: minADE {(m[0] / n).item():.3f} minFDE {(m[1] / n).item():.3f} "
                  f"MR {(m[2] / n).item():.3f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"intent_ep{epoch:02d}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
