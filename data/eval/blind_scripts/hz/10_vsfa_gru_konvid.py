"""VSFA-style VQA on pre-extracted frame features (KoNViD-1k / LIVE-VQC / YouTube-UGC).

Frame features (ResNet-50 mean+std pooled, 4096-d) are extracted offline into
<feat_dir>/<video_id>.npy. A GRU with subjectively-inspired temporal pooling
(min-pooling over a memory window + softmin-weighted future) regresses MOS.

    torchrun --nproc_per_node=4 10_vsfa_gru_konvid.py --feat-dir feats/konvid --info data/konvid_info.csv
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import kendalltau, pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FeatureSet(Dataset):
    def __init__(self, feat_dir, df, max_len):
        self.feat_dir, self.max_len = feat_dir, max_len
        self.ids = df["video_id"].astype(str).tolist()
        self.mos = df["mos_norm"].values.astype(np.float32)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        f = np.load(os.path.join(self.feat_dir, self.ids[i] + ".npy")).astype(np.float32)
        n = min(len(f), self.max_len)
        out = np.zeros((self.max_len, f.shape[1]), dtype=np.float32)
        out[:n] = f[:n]
        return torch.from_numpy(out), n, self.mos[i], i


class TemporalPool(nn.Module):
    def __init__(self, tau=12, beta=0.5):
        super().__init__()
        self.tau, self.beta = tau, beta

    def forward(self, q, lengths):
        scores = []
        for b in range(q.size(0)):
            qb = q[b, :lengths[b]]
            l_mem = torch.stack([qb[max(0, t - self.tau):t + 1].min() for t in range(len(qb))])
            fut = []
            for t in range(len(qb)):
                w = qb[t:t + self.tau + 1]
                a = torch.softmax(-w, 0)
                fut.append((a * w).sum())
            m = torch.stack(fut)
            scores.append((self.beta * m + (1 - self.beta) * l_mem).mean())
        return torch.stack(scores)


class VSFA(nn.Module):
    def __init__(self, in_dim=4096, red_dim=128, hidden=32):
        super().__init__()
        self.reduce = nn.Sequential(nn.Linear(in_dim, red_dim), nn.ReLU(), nn.Dropout(0.5))
        self.gru = nn.GRU(red_dim, hidden, batch_first=True)
        self.q = nn.Linear(hidden, 1)
        self.pool = TemporalPool()

    def forward(self, x, lengths):
        x = self.reduce(x)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        q = self.q(out).squeeze(-1)
        return self.pool(q, lengths)


@torch.no_grad()
def evaluate(model, loader, device, n_videos):
    model.eval()
    preds, labels, idxs = [], [], []
    for feats, lengths, mos, idx in loader:
        out = model(feats.to(device, non_blocking=True), lengths.to(device))
        preds.append(out.float().cpu())
        labels.append(mos)
        idxs.append(idx)
    local = torch.stack([torch.cat(preds), torch.cat(labels), torch.cat(idxs).float()], 1)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    res = torch.cat(gathered).numpy()
    _, keep = np.unique(res[:, 2].astype(np.int64), return_index=True)
    res = res[keep]
    assert len(res) == n_videos
    model.train()
    p, y = res[:, 0], res[:, 1]
    return {"srcc": spearmanr(p, y)[0], "krcc": kendalltau(p, y)[0], "plcc": pearsonr(p, y)[0],
            "rmse": float(np.sqrt(((p - y) ** 2).mean()))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat-dir", required=True)
    ap.add_argument("--info", required=True, help="csv: video_id, mos, split (train/val/test)")
    ap.add_argument("--max-len", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=19920517)
    ap.add_argument("--out", default="models/vsfa_konvid.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    info = pd.read_csv(args.info)
    lo, hi = info["mos"].min(), info["mos"].max()
    info["mos_norm"] = (info["mos"] - lo) / (hi - lo)
    splits = {s: FeatureSet(args.feat_dir, info[info["split"] == s], args.max_len) for s in ("train", "val", "test")}

    train_sampler = DistributedSampler(splits["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(splits["train"], batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    eval_loaders = {s: DataLoader(splits[s], batch_size=32, num_workers=4,
                                  sampler=DistributedSampler(splits[s], shuffle=False)) for s in ("val", "test")}

    model = VSFA().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.epochs // 4, gamma=0.8)

    best_val = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for feats, lengths, mos, _ in train_loader:
            feats = feats.to(device, non_blocking=True)
            lengths = lengths.to(device)
            mos = mos.to(device)
            pred = model(feats, lengths)
            loss = F.l1_loss(pred, mos)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(mos), torch.tensor(float(len(mos)), device=device)])
        scheduler.step()
        dist.all_reduce(total)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            val = evaluate(model, eval_loaders["val"], device, len(splits["val"]))
            if rank == 0:
                print(f"epoch {epoch} train_l1 {total[0] / total[1]:.4f} " +
                      " ".join(f"val_{k}={v:.4f}" for k, v in val.items()), flush=True)
                if val["srcc"] > best_val:
                    best_val = val["srcc"]
                    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                    torch.save(model.module.state_dict(), args.out)
            dist.barrier()

    # final test with the best-on-val weights
    model.module.load_state_dict(torch.load(args.out, map_location=device))
    test = evaluate(model, eval_loaders["test"], device, len(splits["test"]))
    if rank == 0:
        print("TEST " + " ".join(f"{k}={v:.4f}" for k, v in test.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
