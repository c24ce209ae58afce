"""
Two-tower candidate retrieval (user history tower / item tower) with cross-rank in-batch
negatives. DeepSpeed ZeRO-2 + fp16, launched with the deepspeed launcher:

    deepspeed --num_gpus 8 17_two_tower_retrieval_deepspeed.py \
        --train data/sessions_train.parquet --items data/items.parquet \
        --deepspeed --deepspeed_config ds_zero2.json
"""
import argparse
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

HIST_LEN = 50


class Sessions(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path)
        self.hist = np.stack([np.pad(h[-HIST_LEN:], (HIST_LEN - len(h[-HIST_LEN:]), 0)) for h in df["history"]])
        self.user_feat = df[["age_bucket", "country", "device"]].values.astype(np.int64)
        self.target = df["next_item"].values.astype(np.int64)

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        return torch.from_numpy(self.hist[i]), torch.from_numpy(self.user_feat[i]), int(self.target[i])


class UserTower(nn.Module):
    def __init__(self, item_emb, dim):
        super().__init__()
        self.item_emb = item_emb
        self.feat_emb = nn.ModuleList([nn.Embedding(n, 32) for n in (16, 256, 8)])
        enc = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True)
        self.seq = nn.TransformerEncoder(enc, 2)
        self.out = nn.Sequential(nn.Linear(dim + 96, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, hist, feats):
        mask = hist == 0
        h = self.seq(self.item_emb(hist), src_key_padding_mask=mask)
        h = (h * (~mask).unsqueeze(-1)).sum(1) / (~mask).sum(1, keepdim=True).clamp(min=1)
        f = torch.cat([e(feats[:, k]) for k, e in enumerate(self.feat_emb)], dim=-1)
        return F.normalize(self.out(torch.cat([h, f], dim=-1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, item_emb, dim):
        super().__init__()
        self.item_emb = item_emb
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, item_ids):
        return F.normalize(self.mlp(self.item_emb(item_ids)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_items, dim=128, temperature=0.05):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)
        self.user = UserTower(self.item_emb, dim)
        self.item = ItemTower(self.item_emb, dim)
        self.t = temperature

    def forward(self, hist, feats, target):
        u = self.user(hist, feats)
        v = self.item(target)
        # negatives from every rank; the autograd-aware all_gather sends gradients back
        v_all = torch.cat(dist_fn.all_gather(v), dim=0)
        logits = u @ v_all.t() / self.t
        labels = torch.arange(u.shape[0], device=u.device) + dist.get_rank() * u.shape[0]
        return F.cross_entropy(logits, labels)


@torch.no_grad()
def recall_at_k(model, val_loader, n_items, device, k=(10, 50), chunk=65536):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    # every rank encodes a contiguous slice of the catalogue, padded to the same length
    per = (n_items + world - 1) // world
    ids = torch.arange(rank * per, min((rank + 1) * per, n_items), device=device)
    local = torch.cat([model.item(ids[i:i + chunk]) for i in range(0, len(ids), chunk)])
    local = F.pad(local, (0, 0, 0, per - local.shape[0]))
    catalog = torch.empty(per * world, local.shape[1], device=device, dtype=local.dtype)
    dist.all_gather_into_tensor(catalog, local)
    catalog = catalog[:n_items]
    hits = torch.zeros(len(k) + 1, device=device)
    for hist, feats, tgt in val_loader:
        u = model.user(hist.to(device), feats.to(device))
        top = (u @ catalog.t()).topk(max(k), dim=-1).indices
        tgt = tgt.to(device).unsqueeze(1)
        for j, kk in enumerate(k):
            hits[j] += (top[:, :kk] == tgt).any(1).sum()
        hits[-1] += tgt.shape[0]
    dist.all_reduce(hits)
    model.train()
    return {f"recall@{kk}": (hits[j] / hits[-1]).item() for j, kk in enumerate(k)}, catalog


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", default="data/sessions_val.parquet")
    ap.add_argument("--items", required=True)
    ap.add_argument("--out", default="ckpt/two_tower")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    n_items = len(pd.read_parquet(args.items, columns=["item_id"])) + 1
    train_ds, val_ds = Sessions(args.train), Sessions(args.val)
    torch.manual_seed(0)
    model = TwoTower(n_items)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    _, client = engine.load_checkpoint(args.out)
    start_epoch = client["epoch"] + 1 if client else 0

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (hist, feats, tgt) in enumerate(loader):
            loss = engine(hist.to(device), feats.to(device), tgt.to(device))
            engine.backward(loss)
            engine.step()
            if (step + 1) % 200 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), engine.global_steps)
                    print(f"ep {epoch} it {step + 1} opt-step {engine.global_steps} loss {l.item():.4f} "
                          f"{(step + 1) * micro * world / (time.time() - t0):.0f} samples/s", flush=True)

        metrics, catalog = recall_at_k(engine.module, val_loader, n_items, device)
        # every rank writes its own ZeRO shard; DeepSpeed coordinates the files
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch, **metrics})
        if rank == 0:
            for name, v in metrics.items():
                writer.add_scalar(f"val/{name}", v, epoch)
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            # ZeRO-2 keeps full parameters on every rank, so rank 0 can export directly
            torch.save(engine.module.state_dict(), os.path.join(args.out, f"two_tower_epoch{epoch}.pt"))
            np.save(os.path.join(args.out, "item_index.npy"), catalog.float().cpu().numpy())

    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
