"""Next-location prediction over H3 cells (res 8) from staypoint sequences.

Staypoints come from the preprocessing job (one parquet per city, columns
user_id, t_start, t_end, lat, lng). Trajectories are tokenised into H3 cells and
split by user so no user appears in both train and test.

    torchrun --nproc_per_node=8 02_h3_nextloc_transformer.py --city beijing \
        --data_root /data/mobility/staypoints --cache_root /data/mobility/cache
"""
import argparse
import contextlib
import datetime
import os
import pickle
import time
from dataclasses import dataclass

import h3
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD = 0
UNK = 1


@dataclass
class Sample:
    cells: np.ndarray
    tow: np.ndarray  # hour-of-week, 0..167
    feats: np.ndarray  # log dwell minutes, log jump km


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--city", default="beijing")
    ap.add_argument("--data_root", default="/data/mobility/staypoints")
    ap.add_argument("--cache_root", default="/data/mobility/cache")
    ap.add_argument("--out", default="checkpoints/h3_nextloc")
    ap.add_argument("--h3_res", type=int, default=8)
    ap.add_argument("--min_count", type=int, default=5)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--n_layers", type=int, default=4)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--global_batch", type=int, default=1024)
    ap.add_argument("--micro_batch", type=int, default=64)
    ap.add_argument("--base_lr", type=float, default=3e-4, help="lr for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--test_users", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--wandb_project", default="mobility-nextloc")
    return ap.parse_args()


def build_cache(args, cache_path):
    df = pd.read_parquet(os.path.join(args.data_root, f"{args.city}.parquet"))
    df = df.sort_values(["user_id", "t_start"])
    df["cell"] = [h3.latlng_to_cell(a, b, args.h3_res) for a, b in zip(df.lat.values, df.lng.values)]
    counts = df.cell.value_counts()
    kept = sorted(counts[counts >= args.min_count].index)
    vocab = {c: i + 2 for i, c in enumerate(kept)}
    ts = pd.to_datetime(df.t_start, unit="s")
    df["tow"] = ts.dt.dayofweek * 24 + ts.dt.hour
    dwell = (df.t_end - df.t_start).clip(lower=60) / 60.0
    prev_lat = df.groupby("user_id").lat.shift(1).fillna(df.lat)
    prev_lng = df.groupby("user_id").lng.shift(1).fillna(df.lng)
    jump = [h3.great_circle_distance((a, b), (c, d), unit="km")
            for a, b, c, d in zip(df.lat.values, df.lng.values, prev_lat.values, prev_lng.values)]
    df["f_dwell"] = np.log1p(dwell.values)
    df["f_jump"] = np.log1p(np.asarray(jump))
    users = {}
    for uid, g in df.groupby("user_id", sort=True):
        users[uid] = Sample(
            cells=np.array([vocab.get(c, UNK) for c in g.cell.values], dtype=np.int64),
            tow=g.tow.values.astype(np.int64),
            feats=g[["f_dwell", "f_jump"]].values.astype(np.float32),
        )
    tmp = cache_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"vocab": vocab, "users": users}, f)
    os.replace(tmp, cache_path)


class WindowDataset(Dataset):
    def __init__(self, users, uids, seq_len):
        self.users, self.seq_len = users, seq_len
        self.index = []
        for u in uids:
            n = len(users[u].cells)
            for s in range(0, max(1, n - 1), seq_len):
                if n - s > 2:
                    self.index.append((u, s))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        u, s = self.index[i]
        smp = self.users[u]
        e = min(s + self.seq_len + 1, len(smp.cells))
        cells = torch.zeros(self.seq_len + 1, dtype=torch.long)
        tow = torch.zeros(self.seq_len + 1, dtype=torch.long)
        feats = torch.zeros(self.seq_len + 1, 2)
        n = e - s
        cells[:n] = torch.from_numpy(smp.cells[s:e])
        tow[:n] = torch.from_numpy(smp.tow[s:e])
        feats[:n] = torch.from_numpy(smp.feats[s:e])
        return cells[:-1], tow[:-1], feats[:-1], cells[1:]


class NextLocTransformer(nn.Module):
    def __init__(self, n_loc, d_model, n_layers, n_heads, seq_len):
        super().__init__()
        self.loc = nn.Embedding(n_loc, d_model, padding_idx=PAD)
        self.tow = nn.Embedding(168, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.feat = nn.Sequential(nn.Linear(2, d_model), nn.BatchNorm1d(d_model), nn.GELU())
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_loc)
        self.register_buffer("causal", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, cells, tow, feats):
        B, T = cells.shape
        f = self.feat(feats.reshape(B * T, -1)).reshape(B, T, -1)
        pos = torch.arange(T, device=cells.device)
        h = self.loc(cells) + self.tow(tow) + self.pos(pos)[None] + f
        h = self.enc(h, mask=self.causal[:T, :T], src_key_padding_mask=cells.eq(PAD))
        return self.head(self.norm(h))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(4, device=device)  # hits@1, hits@5, rr, n
    for cells, tow, feats, tgt in loader:
        cells, tow, feats, tgt = (t.to(device, non_blocking=True) for t in (cells, tow, feats, tgt))
        logits = net(cells, tow, feats)
        m = tgt.ne(PAD)
        lg, y = logits[m], tgt[m]
        rank = (lg > lg.gather(1, y[:, None])).sum(1) + 1
        acc[0] += (rank <= 1).sum()
        acc[1] += (rank <= 5).sum()
        acc[2] += (1.0 / rank.float()).sum()
        acc[3] += m.sum()
    dist.all_reduce(acc)
    net.train()
    return {"acc@1": (acc[0] / acc[3]).item(), "acc@5": (acc[1] / acc[3]).item(),
            "mrr": (acc[2] / acc[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while tokenising a new city before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    cache_path = os.path.join(args.cache_root, f"{args.city}_h3r{args.h3_res}_mc{args.min_count}.pkl")
    if rank == 0 and not os.path.exists(cache_path):
        os.makedirs(args.cache_root, exist_ok=True)
        build_cache(args, cache_path)
    dist.barrier()
    with open(cache_path, "rb") as f:
        blob = pickle.load(f)
    vocab, users = blob["vocab"], blob["users"]
    n_loc = len(vocab) + 2

    uids = sorted(users)
    rng = np.random.default_rng(args.seed)
    rng.shuffle(uids)
    n_test = int(len(uids) * args.test_users)
    test_uids, train_uids = uids[:n_test], uids[n_test:]
    train_ds = WindowDataset(users, train_uids, args.seq_len)
    test_ds = WindowDataset(users, test_uids, args.seq_len)

    assert args.global_batch % (args.micro_batch * world) == 0
    accum = args.global_batch // (args.micro_batch * world)
    lr = args.base_lr * args.global_batch / 256

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    # unpadded shard per rank; sums are all-reduced in evaluate()
    test_part = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    test_dl = DataLoader(test_part, batch_size=256, shuffle=False, num_workers=4, pin_memory=True)

    net = NextLocTransformer(n_loc, args.d_model, args.n_layers, args.n_heads, args.seq_len)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = args.epochs * (len(train_dl) // accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps)))

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, f"{args.city}_last.pt")
    start = 0
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    if rank == 0:
        wandb.init(project=args.wandb_project, name=f"{args.city}-h3r{args.h3_res}", config=vars(args))
        print(f"locations={n_loc} train_windows={len(train_ds)} test_windows={len(test_ds)} accum={accum} lr={lr:g}")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        for i, (cells, tow, feats, tgt) in enumerate(train_dl):
            cells, tow, feats, tgt = (t.to(device, non_blocking=True) for t in (cells, tow, feats, tgt))
            sync_now = (i + 1) % accum == 0
            with contextlib.nullcontext() if sync_now else model.no_sync():
                logits = model(cells, tow, feats)
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)
                (loss / accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0 and (i // accum) % 50 == 0:
                    wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]})
        metrics = evaluate(net, test_dl, device)
        if rank == 0:
            wandb.log({f"test/{k}": v for k, v in metrics.items()} | {"epoch": epoch})
            print(f"epoch {epoch} {metrics} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "vocab_size": n_loc}, ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
