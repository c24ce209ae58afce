"""GameFormer-style level-k interactive prediction for the WOMD interactive split.

Two interacting target agents per scene; the decoder runs K reasoning levels where level k
attends to the level k-1 predictions of the other agent.

    torchrun --nproc_per_node=8 16_gameformer_interactive.py --train /data/womd_interactive/train \
        --valid /data/womd_interactive/valid --name gameformer_l3
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FUT = 80
MODES = 6
MIN_FUTURE_STEPS = 40  # targets with fewer valid future steps are not supervised


class InteractivePairs(Dataset):
    def __init__(self, path):
        self.files = sorted(glob.glob(os.path.join(path, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        return {
            "ego": torch.from_numpy(d["ego"].astype(np.float32)),  # [2, 11, 8] the interacting pair
            "neighbors": torch.from_numpy(d["neighbors"].astype(np.float32)),  # [20, 11, 8]
            "map_lanes": torch.from_numpy(d["map_lanes"].astype(np.float32)),  # [2, 6, 100, 17]
            "map_crosswalks": torch.from_numpy(d["map_crosswalks"].astype(np.float32)),  # [2, 4, 100, 3]
            "gt": torch.from_numpy(d["ground_truth"].astype(np.float32)),  # [2, 80, 5]
        }


class AgentEncoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lstm = nn.LSTM(8, d, 2, batch_first=True)

    def forward(self, x):  # [B, N, T, 8]
        B, N, T, C = x.shape
        _, (h, _) = self.lstm(x.reshape(B * N, T, C))
        return h[-1].view(B, N, -1)


class LevelKDecoder(nn.Module):
    def __init__(self, d, first=False):
        super().__init__()
        self.first = first
        self.mode_emb = nn.Embedding(MODES, d)
        if not first:
            self.future_enc = nn.Sequential(nn.Linear(FUT * 2, d), nn.ReLU(), nn.Linear(d, d))
        self.attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.traj = nn.Linear(d, FUT * 4)
        self.score = nn.Linear(d, 1)

    def forward(self, agent_feat, ctx, ctx_pad, prev_traj=None, prev_score=None):
        # agent_feat [B, 2, d]; queries: one per mode per agent
        B = agent_feat.shape[0]
        q = agent_feat[:, :, None] + self.mode_emb.weight[None, None]  # [B, 2, M, d]
        if not self.first:
            # interaction: add the other agent's previous-level futures (score-weighted)
            other = prev_traj.flip(1)[..., :2].flatten(3)  # [B, 2, M, FUT*2]
            w = prev_score.flip(1).softmax(-1)[..., None]
            q = q + (self.future_enc(other) * w).sum(2, keepdim=True)
        q = q.flatten(1, 2)
        h = self.norm(q + self.attn(q, ctx, ctx, key_padding_mask=ctx_pad)[0])
        h = h + self.ff(h)
        traj = self.traj(h).view(B, 2, MODES, FUT, 4)
        return traj, self.score(h).view(B, 2, MODES)


class GameFormer(nn.Module):
    def __init__(self, d=256, levels=3):
        super().__init__()
        self.agents = AgentEncoder(d)
        self.lanes = nn.Sequential(nn.Linear(17, d), nn.ReLU(), nn.Linear(d, d))
        self.xwalks = nn.Sequential(nn.Linear(3, d), nn.ReLU(), nn.Linear(d, d))
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True)
        self.fusion = nn.TransformerEncoder(layer, 3)
        self.levels = nn.ModuleList(LevelKDecoder(d, first=(k == 0)) for k in range(levels + 1))

    def forward(self, b):
        actors = torch.cat([b["ego"], b["neighbors"]], 1)
        a = self.agents(actors)
        a_pad = actors[:, :, -1].abs().sum(-1) == 0
        lanes = self.lanes(b["map_lanes"]).max(3).values.flatten(1, 2)
        l_pad = b["map_lanes"].abs().sum((-1, -2)).flatten(1) == 0
        xw = self.xwalks(b["map_crosswalks"]).max(3).values.flatten(1, 2)
        x_pad = b["map_crosswalks"].abs().sum((-1, -2)).flatten(1) == 0
        ctx = torch.cat([a, lanes, xw], 1)
        pad = torch.cat([a_pad, l_pad, x_pad], 1)
        pad[:, :2] = False
        ctx = self.fusion(ctx, src_key_padding_mask=pad)
        outs = []
        traj = score = None
        for dec in self.levels:
            traj, score = dec(ctx[:, :2], ctx, pad, traj, score)
            outs.append((traj, score))
        return outs


def level_loss(traj, score, gt, valid):
    vm = valid[:, :, None].float()  # [B, 2, 1, T]
    err = (traj[..., :2] - gt[:, :, None, :, :2]).norm(dim=-1)
    # joint mode selection: the same mode index for both agents
    joint = (err * vm).sum((1, 3)) / vm.sum((1, 3)).clamp(min=1)  # [B, M]
    best = joint.argmin(-1)
    r = torch.arange(len(best), device=traj.device)
    sel = traj[r, :, best]  # [B, 2, T, 4]
    mu, log_s = sel[..., :2], sel[..., 2:].clamp(-5, 5)
    nll = (torch.abs(gt[..., :2] - mu) / log_s.exp() + log_s).sum(-1)
    nll = (nll * valid).sum() / valid.sum().clamp(min=1)
    cls = F.cross_entropy(score.sum(1), best)
    return nll + 0.5 * cls, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--name", default="gameformer")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--levels", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log_dir = os.path.join("training_log", args.name)
    if rank == 0:
        os.makedirs(log_dir, exist_ok=True)

    train_set, valid_set = InteractivePairs(args.train), InteractivePairs(args.valid)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=args.batch_size, sampler=valid_sampler, num_workers=8)

    model = DDP(GameFormer(levels=args.levels).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 22, 24, 26, 28], gamma=0.5)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        losses = []
        for b in train_loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            valid = b["gt"][..., 4] > 0  # [B, 2, T]
            supervised = valid.sum(-1).min(-1).values >= MIN_FUTURE_STEPS
            if not supervised.any():
                continue
            b = {k: v[supervised] for k, v in b.items()}
            valid = valid[supervised]
            outs = model(b)
            loss = sum(level_loss(traj, score, b["gt"], valid)[0] for traj, score in outs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()

        model.eval()
        stats = torch.zeros(4, device=device)
        with torch.no_grad():
            for b in valid_loader:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                valid = b["gt"][..., 4] > 0
                traj, score = model(b)[-1]
                _, err = level_loss(traj, score, b["gt"], valid)  # err [B, 2, M, T]
                full = valid[..., -1].all(-1)
                joint_ade = err.mean(-1).mean(1).min(-1).values
                joint_fde = err[..., -1].mean(1).min(-1).values
                miss = (err[..., -1].max(1).values.min(-1).values > 2.0).float()
                stats += torch.stack([joint_ade[full].sum(), joint_fde[full].sum(), miss[full].sum(),
                                      full.sum().float()])
        dist.all_reduce(stats)
        n = stats[3].clamp(min=1)
        if rank == 0:
            logging.info("epoch %d train loss %.4f | minJointADE %.3f minJointFDE %.3f joint MR %.3f | %.0fs",
                         epoch, float(np.mean(losses)) if losses else float("nan"), (stats[0] / n).item(),
                         (stats[1] / n).item(), (stats[2] / n).item(), time.time() - t0)
            torch.save(model.module.state_dict(), os.path.join(log_dir, f"model_{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
