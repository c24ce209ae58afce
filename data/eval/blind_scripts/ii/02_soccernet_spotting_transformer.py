"""Temporal action spotting on SoccerNet-v2 style pre-extracted features.

Each match half is a (T, D) feature array at 2 fps. Training samples are windows
cut from the halves; the model predicts per-frame event scores and, for events
annotated with a side, which team (home / away) performed the action.
Evaluation runs the model over full halves with a sliding window, applies 1-D
NMS and computes the tolerance-averaged mAP (loose: 5..60 s).

Launch:
    torchrun --nproc_per_node=8 02_soccernet_spotting_transformer.py --root /data/soccernet
"""
import argparse
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Penalty", "Kick-off", "Goal", "Substitution", "Offside", "Shots on target", "Shots off target",
           "Clearance", "Ball out of play", "Throw-in", "Foul", "Indirect free-kick", "Direct free-kick",
           "Corner", "Yellow card", "Red card", "Yellow->red card"]
FPS = 2
TEAM_IDS = {"home": 0, "away": 1}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--feature-file", default="baidu_soccer_embeddings.npy")
    p.add_argument("--window", type=int, default=60, help="seconds per training window")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="windows per GPU per micro-step")
    p.add_argument("--accum-steps", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=2e-4, help="lr at a global batch of 256 windows")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--team-weight", type=float, default=0.5)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--out", type=Path, default=Path("checkpoints/spotting_tf"))
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def load_half(root, match, half, feature_file, num_frames=None):
    feats = np.load(root / match / f"{half}_{feature_file}").astype(np.float32)
    T = feats.shape[0] if num_frames is None else num_frames
    labels = np.zeros((T, len(CLASSES)), np.float32)
    team = np.full(T, -1, np.int64)
    ann = json.loads((root / match / "Labels-v2.json").read_text())["annotations"]
    for a in ann:
        h, mmss = a["gameTime"].split(" - ")
        if int(h) != half or a["label"] not in CLASSES:
            continue
        mm, ss = mmss.split(":")
        f = min(T - 1, (int(mm) * 60 + int(ss)) * FPS)
        labels[f, CLASSES.index(a["label"])] = 1.0
        if a.get("team") in TEAM_IDS:
            team[f] = TEAM_IDS[a["team"]]
    return feats, labels, team


class WindowDataset(Dataset):
    def __init__(self, root, matches, feature_file, window_s):
        self.win = window_s * FPS
        self.halves, self.index = [], []
        for m in matches:
            for half in (1, 2):
                feats, labels, team = load_half(root, m, half, feature_file)
                h = len(self.halves)
                self.halves.append((feats, labels, team))
                for start in range(0, max(1, feats.shape[0] - self.win), self.win // 2):
                    self.index.append((h, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        h, start = self.index[i]
        feats, labels, team = self.halves[h]
        start = min(max(0, start + random.randint(-self.win // 4, self.win // 4)), max(0, feats.shape[0] - self.win))
        sl = slice(start, start + self.win)
        x, y, t = feats[sl], labels[sl], team[sl]
        if x.shape[0] < self.win:
            pad = self.win - x.shape[0]
            x = np.pad(x, ((0, pad), (0, 0)))
            y = np.pad(y, ((0, pad), (0, 0)))
            t = np.pad(t, (0, pad), constant_values=-1)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(t)


class SpottingTransformer(nn.Module):
    def __init__(self, in_dim, d_model, layers, num_classes, max_len=4096, grad_ckpt=False):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_dim, d_model), nn.LayerNorm(d_model))
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(layers)])
        self.norm = nn.LayerNorm(d_model)
        self.event_head = nn.Linear(d_model, num_classes)
        self.team_head = nn.Sequential(nn.Linear(d_model, d_model // 2), nn.GELU(), nn.Linear(d_model // 2, 2))
        self.grad_ckpt = grad_ckpt

    def forward(self, x, team_mask=None):
        h = self.proj(x) + self.pos[:, : x.shape[1]]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        h = self.norm(h)
        events = self.event_head(h)
        # team side is only annotated on a few frames; skip the head when a window has none
        team = self.team_head(h[team_mask]) if team_mask is not None and team_mask.any() else None
        return events, team


@torch.no_grad()
def predict_half(model, feats, win, device):
    T = feats.shape[0]
    scores = torch.zeros(T, len(CLASSES))
    counts = torch.zeros(T, 1)
    for s in range(0, T, win // 2):
        chunk = torch.from_numpy(feats[s:s + win]).to(device)
        ev, _ = model(chunk[None])
        scores[s:s + chunk.shape[0]] += ev[0].sigmoid().float().cpu()
        counts[s:s + chunk.shape[0]] += 1
    return scores / counts


def nms_1d(scores, window=20, thresh=0.05):
    dets = []
    for c in range(scores.shape[1]):
        s = scores[:, c].clone()
        while True:
            v, i = s.max(0)
            if v < thresh:
                break
            dets.append((c, int(i) / FPS, float(v)))
            s[max(0, i - window // 2): i + window // 2 + 1] = 0
    return dets


def average_map(preds, gts, tolerances=range(5, 65, 5)):
    """preds/gts: {(match, half): [(cls, t_sec, conf)]} / {(match, half): [(cls, t_sec)]}"""
    maps = []
    for tol in tolerances:
        aps = []
        for c in range(len(CLASSES)):
            n_gt = sum(1 for v in gts.values() for g in v if g[0] == c)
            if n_gt == 0:
                continue
            cand = sorted(((conf, key, t) for key, v in preds.items() for cc, t, conf in v if cc == c), reverse=True)
            used = {key: [False] * len(v) for key, v in gts.items()}
            tp = []
            for conf, key, t in cand:
                best_j, best_d = -1, tol / 2
                for j, (gc, gt_t) in enumerate(gts.get(key, [])):
                    if gc == c and not used[key][j] and abs(gt_t - t) <= best_d:
                        best_j, best_d = j, abs(gt_t - t)
                if best_j >= 0:
                    used[key][best_j] = True
                tp.append(best_j >= 0)
            tp = np.array(tp, dtype=np.float64)
            ctp = np.cumsum(tp)
            prec = ctp / np.arange(1, len(tp) + 1)
            rec = ctp / n_gt
            ap = np.sum(prec * tp) / n_gt if len(tp) else 0.0
            aps.append(ap if rec.size else 0.0)
        maps.append(np.mean(aps))
    return float(np.mean(maps))


def evaluate(model, root, matches, args, device):
    model.eval()
    local_preds, local_gts = {}, {}
    for m in matches:
        for half in (1, 2):
            feats, labels, _ = load_half(root, m, half, args.feature_file)
            local_preds[(m, half)] = nms_1d(predict_half(model, feats, args.window * FPS, device))
            local_gts[(m, half)] = [(int(c), f / FPS) for f, c in zip(*np.nonzero(labels))]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local_preds, local_gts))
    model.train()
    preds, gts = {}, {}
    for p, g in gathered:
        preds.update(p)
        gts.update(g)
    return average_map(preds, gts)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    split = json.loads((args.root / "splits.json").read_text())
    train_ds = WindowDataset(args.root, split["train"], args.feature_file, args.window)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_matches = sorted(split["valid"])[rank::world]

    in_dim = train_ds.halves[0][0].shape[1]
    model = SpottingTransformer(in_dim, args.d_model, args.layers, len(CLASSES), grad_ckpt=args.grad_ckpt).to(device)
    # team_head is skipped on micro-batches without a team-annotated frame
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    global_batch = args.batch_size * args.accum_steps * world
    lr = args.base_lr * global_batch / 256
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    updates_per_epoch = len(loader) // args.accum_steps
    total, warm = args.epochs * updates_per_epoch, args.warmup_epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    args.out.mkdir(parents=True, exist_ok=True)
    start_epoch, best_map = 0, 0.0
    if (args.out / "last.pt").exists():
        ckpt = torch.load(args.out / "last.pt", map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_map = ckpt["epoch"] + 1, ckpt["best_map"]
    if rank == 0:
        print(f"{len(train_ds)} windows, global batch {global_batch}, lr {lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for i, (x, y, team) in enumerate(loader):
            if i >= updates_per_epoch * args.accum_steps:
                break
            x, y, team = x.to(device, non_blocking=True), y.to(device, non_blocking=True), team.to(device)
            team_mask = team >= 0
            sync = (i + 1) % args.accum_steps == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if sync:
                    ev, team_logits = model(x, team_mask)
                else:
                    with model.no_sync():
                        ev, team_logits = model(x, team_mask)
                loss = F.binary_cross_entropy_with_logits(ev.float(), y, pos_weight=torch.full((len(CLASSES),), 5.0, device=device))
                if team_logits is not None:
                    loss = loss + args.team_weight * F.cross_entropy(team_logits.float(), team[team_mask])
            if sync:
                (loss / args.accum_steps).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    (loss / args.accum_steps).backward()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(run)
        val_map = evaluate(model.module, args.root, val_matches, args, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {run[0] / run[1]:.4f} | val loose avg-mAP {100 * val_map:.2f}")
            state = {"model": model.module.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best_map": max(best_map, val_map), "args": vars(args)}
            torch.save(state, args.out / "last.pt.tmp")
            os.replace(args.out / "last.pt.tmp", args.out / "last.pt")
            if val_map > best_map:
                torch.save(state["model"], args.out / "best_model.pt")
        best_map = max(best_map, val_map)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
