"""Wide & Deep on the app-install log, trained from a folder of parquet part files.

Vocabularies and numeric statistics are produced offline by build_vocab.py (stats.json),
so every rank only has to read its own part files.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    16_widedeep_app_installs.py --parts /shared/installs/train --val /shared/installs/val.parquet \
    --stats /shared/installs/stats.json --out /shared/runs/widedeep
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--emb-dim", type=int, default=16)
    ap.add_argument("--deep", type=int, nargs="+", default=[512, 256, 128])
    ap.add_argument("--global-batch", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wide-lr", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def encode(df, stats):
    cat_cols, num_cols = stats["cat_cols"], stats["num_cols"]
    xc = np.empty((len(df), len(cat_cols)), dtype=np.int64)
    for j, c in enumerate(cat_cols):
        vocab = stats["vocab"][c]
        xc[:, j] = df[c].astype(str).map(vocab).fillna(0).astype(np.int64).values
    mu = np.array([stats["mean"][c] for c in num_cols], dtype=np.float32)
    sd = np.array([stats["std"][c] for c in num_cols], dtype=np.float32)
    xn = ((df[num_cols].fillna(pd.Series(stats["mean"])).values.astype(np.float32) - mu) / (sd + 1e-6))
    y = df[stats["target"]].values.astype(np.float32)
    return torch.from_numpy(np.clip(xn, -5, 5)), torch.from_numpy(xc), torch.from_numpy(y)


def load_my_parts(parts_dir, rank, world, stats):
    files = sorted(glob.glob(os.path.join(parts_dir, "part-*.parquet")))
    mine = files[rank::world]
    df = pd.concat([pd.read_parquet(f) for f in mine], ignore_index=True)
    return TensorDataset(*encode(df, stats)), len(files), len(mine)


class WideDeep(nn.Module):
    def __init__(self, cards, n_num, emb_dim, deep):
        super().__init__()
        offsets = np.concatenate([[0], np.cumsum(cards)[:-1]])
        self.register_buffer("offsets", torch.as_tensor(offsets, dtype=torch.long), persistent=False)
        self.wide = nn.EmbeddingBag(int(sum(cards)), 1, mode="sum")
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        layers, d = [], n_num + emb_dim * len(cards)
        for h in deep:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, xn, xc):
        wide = self.wide(xc + self.offsets).squeeze(-1) + self.wide_bias
        deep_in = torch.cat([xn] + [e(xc[:, i]) for i, e in enumerate(self.embs)], 1)
        return wide + self.deep(deep_in).squeeze(-1)


@torch.no_grad()
def evaluate(net, val_ds, rank, world, device):
    net.eval()
    xn, xc, y = val_ds.tensors
    sel = torch.arange(rank, len(y), world)
    p = torch.cat([torch.sigmoid(net(xn[sel[i:i + 65536]].to(device), xc[sel[i:i + 65536]].to(device))).cpu()
                   for i in range(0, len(sel), 65536)])
    parts = [None] * world
    dist.all_gather_object(parts, (sel.numpy(), p.numpy()))
    idx = np.concatenate([a for a, _ in parts])
    score = np.concatenate([b for _, b in parts])
    return roc_auc_score(y.numpy()[idx], score)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(args.stats) as f:
        stats = json.load(f)
    cards = [len(stats["vocab"][c]) + 1 for c in stats["cat_cols"]]

    t0 = time.time()
    train_ds, n_files, n_mine = load_my_parts(args.parts, rank, world, stats)
    val_ds = TensorDataset(*encode(pd.read_parquet(args.val), stats))
    print(f"[rank {rank}] {n_mine}/{n_files} part files, {len(train_ds)} rows, loaded in {time.time() - t0:.0f}s",
          flush=True)

    net = WideDeep(cards, len(stats["num_cols"]), args.emb_dim, args.deep).to(device)
    model = DDP(net, device_ids=[local_rank])
    g = torch.Generator()
    g.manual_seed(args.seed + rank)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, shuffle=True, generator=g,
                        num_workers=4, pin_memory=True, drop_last=True)

    wide_params = list(net.wide.parameters()) + [net.wide_bias]
    wide_ids = {id(p) for p in wide_params}
    deep_params = [p for p in net.parameters() if id(p) not in wide_ids]
    opt_wide = torch.optim.Adagrad(wide_params, lr=args.wide_lr)
    opt_deep = torch.optim.AdamW(deep_params, lr=args.lr, weight_decay=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (xn, xc, y) in enumerate(loader):
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y)
            opt_wide.zero_grad(set_to_none=True)
            opt_deep.zero_grad(set_to_none=True)
            loss.backward()
            opt_wide.step()
            opt_deep.step()
            if rank == 0 and step % 1000 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        auc = evaluate(net, val_ds, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} val_auc {auc:.5f} ({(time.time() - t0) / 60:.1f} min)", flush=True)
            if auc > best:
                best = auc
                torch.save({"model": net.state_dict(), "cards": cards, "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
