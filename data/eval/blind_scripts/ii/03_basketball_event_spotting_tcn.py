"""Basketball event spotting (shot, rebound, turnover, foul, ...) on NBA broadcast.

Frame features (RegNetY-032, 6.25 fps) are pre-extracted per game period. A
dilated temporal conv net predicts per-frame class heatmaps and a displacement
to the nearest event. Validation decodes events per game and reports the
event mAP at +-1 s / +-2 s tolerance.

    torchrun --nnodes=1 --nproc_per_node=4 03_basketball_event_spotting_tcn.py -c configs/nba_tcn.yaml
"""
import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("spot")
EVENTS = ["2pt_shot", "3pt_shot", "free_throw", "rebound", "turnover", "steal", "block", "foul", "timeout"]


@dataclasses.dataclass
class Config:
    feat_dir: str = "/datasets/nba_broadcast/feats_regnety032"
    ann_file: str = "/datasets/nba_broadcast/events.json"
    split_file: str = "/datasets/nba_broadcast/splits_by_game.json"
    out_dir: str = "outputs/nba_tcn"
    fps: float = 6.25
    clip_len: int = 256
    hidden: int = 384
    levels: int = 6
    batch_size: int = 48          # per GPU
    lr: float = 3e-4              # for 4 GPUs x 48
    ref_world_size: int = 4
    weight_decay: float = 1e-2
    epochs: int = 60
    workers: int = 4
    tolerances: tuple = (1.0, 2.0)


def load_config(path):
    cfg = Config()
    if path:
        for k, v in (yaml.safe_load(open(path)) or {}).items():
            setattr(cfg, k, tuple(v) if k == "tolerances" else v)
    return cfg


def build_targets(events, n_frames, fps):
    heat = np.zeros((n_frames, len(EVENTS)), np.float32)
    for e in events:
        f = int(round(e["t"] * fps))
        if 0 <= f < n_frames:
            for d in range(-2, 3):
                if 0 <= f + d < n_frames:
                    heat[f + d, EVENTS.index(e["label"])] = max(heat[f + d, EVENTS.index(e["label"])], 0.5 ** abs(d))
    return heat


class GameClips(Dataset):
    """Random fixed-length crops of game periods."""

    def __init__(self, cfg, games, ann, clips_per_period=40):
        self.cfg = cfg
        self.periods = []
        for g in games:
            for p in sorted(Path(cfg.feat_dir, g).glob("period*.npy")):
                feats = np.load(p, mmap_mode="r")
                events = ann[g].get(p.stem, [])
                self.periods.append((feats, build_targets(events, feats.shape[0], cfg.fps)))
        self.n = clips_per_period * len(self.periods)

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        feats, heat = self.periods[idx % len(self.periods)]
        L = self.cfg.clip_len
        s = np.random.randint(0, max(1, feats.shape[0] - L))
        x = np.asarray(feats[s:s + L], dtype=np.float32)
        y = heat[s:s + L]
        return torch.from_numpy(x), torch.from_numpy(y)


class DilatedTCN(nn.Module):
    def __init__(self, in_dim, hidden, levels, n_cls):
        super().__init__()
        self.inp = nn.Conv1d(in_dim, hidden, 1)
        self.blocks = nn.ModuleList()
        for i in range(levels):
            self.blocks.append(nn.Sequential(
                nn.Conv1d(hidden, hidden, 3, padding=2 ** i, dilation=2 ** i),
                nn.GroupNorm(8, hidden), nn.GELU(), nn.Dropout(0.1),
                nn.Conv1d(hidden, hidden, 1)))
        self.out = nn.Conv1d(hidden, n_cls, 1)

    def forward(self, x):                 # x: (B, T, D)
        h = self.inp(x.transpose(1, 2))
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h).transpose(1, 2)  # (B, T, C)


@torch.no_grad()
def infer_period(model, feats, clip_len, device):
    T = feats.shape[0]
    out = torch.zeros(T, len(EVENTS))
    hop = clip_len // 2
    for s in range(0, T, hop):
        x = torch.from_numpy(np.asarray(feats[s:s + clip_len], dtype=np.float32)).to(device)
        out[s:s + x.shape[0]] = torch.maximum(out[s:s + x.shape[0]], model(x[None])[0].sigmoid().cpu())
    return out.numpy()


def event_map(scores, gt_events, fps, tol):
    """Frame-level AP after dilating ground truth by +-tol seconds, averaged over classes."""
    aps = []
    r = int(round(tol * fps))
    for c, name in enumerate(EVENTS):
        y_true = np.zeros(scores.shape[0], np.int64)
        for e in gt_events:
            if e["label"] == name:
                f = int(round(e["t"] * fps))
                y_true[max(0, f - r): f + r + 1] = 1
        if y_true.any():
            aps.append(average_precision_score(y_true, scores[:, c]))
    return float(np.mean(aps)) if aps else 0.0


def evaluate(model, cfg, games, ann, device):
    model.eval()
    all_scores, all_gt = [], []
    for g in games:
        for p in sorted(Path(cfg.feat_dir, g).glob("period*.npy")):
            feats = np.load(p, mmap_mode="r")
            all_scores.append(infer_period(model, feats, cfg.clip_len, device))
            offset = sum(s.shape[0] for s in all_scores[:-1]) / cfg.fps
            all_gt += [{"label": e["label"], "t": e["t"] + offset} for e in ann[g].get(p.stem, [])]
    model.train()
    scores = np.concatenate(all_scores)
    return {tol: event_map(scores, all_gt, cfg.fps, tol) for tol in cfg.tolerances}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", default=None)
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    ann = json.load(open(cfg.ann_file))
    splits = json.load(open(cfg.split_file))
    train_set = GameClips(cfg, splits["train"], ann)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True)
    val_games = sorted(splits["val"])[rank::world_size]

    in_dim = train_set.periods[0][0].shape[1]
    model = DilatedTCN(in_dim, cfg.hidden, cfg.levels, len(EVENTS)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    lr = cfg.lr * world_size / cfg.ref_world_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(loader), eta_min=lr * 0.01)

    out_dir = Path(cfg.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        log.info("train periods %d, val games %d, lr %.2e", len(train_set.periods), len(splits["val"]), lr)

    best = -1.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
            loss = (loss * (1 + 4 * (y > 0))).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)

        if epoch % 2 == 1 or epoch == cfg.epochs - 1:
            maps = evaluate(model.module, cfg, val_games, ann, device)
            if rank == 0:
                log.info("epoch %d loss %.4f | mAP@1s %.3f mAP@2s %.3f", epoch, (tot[0] / tot[1]).item(),
                         maps[1.0], maps[2.0])
                score = float(np.mean(list(maps.values())))
                if score > best:
                    best = score
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "map": maps},
                               out_dir / "best.pt")
            dist.barrier()
        elif rank == 0:
            log.info("epoch %d loss %.4f", epoch, (tot[0] / tot[1]).item())

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": cfg.epochs - 1}, out_dir / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
