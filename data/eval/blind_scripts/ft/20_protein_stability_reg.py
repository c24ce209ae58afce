"""Protein stability (ddG) regression with a ByteNet-style dilated CNN.

Training uses length-bucketed token-budget batches; the checkpoint with the best
validation Spearman is reloaded at the end and scored on the held-out test split.

    torchrun --nproc_per_node=4 20_protein_stability_reg.py --data-dir data/megascale --out runs/bytenet_ddg
"""
import argparse
import csv
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

VOCAB = {a: i + 1 for i, a in enumerate("ACDEFGHIKLMNPQRSTVWY")}


class StabilityData(Dataset):
    def __init__(self, path):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        self.seqs = [r["aa_seq"] for r in rows]
        self.y = np.array([float(r["deltaG"]) for r in rows], dtype=np.float32)
        self.lengths = np.array([len(s) for s in self.seqs])

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return torch.tensor([VOCAB.get(a, 0) for a in self.seqs[i]]), self.y[i], i


def collate(batch):
    seqs, ys, idx = zip(*batch)
    return (nn.utils.rnn.pad_sequence(seqs, batch_first=True), torch.tensor([len(s) for s in seqs]),
            torch.tensor(ys), torch.tensor(idx))


class DistributedTokenBatchSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, pad=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.pad, self.epoch = shuffle, seed, pad, 0
        order = np.argsort(lengths, kind="stable")
        self.batches, cur = [], []
        for i in order:
            if cur and lengths[i] * (len(cur) + 1) > max_tokens:
                self.batches.append(cur)
                cur = []
            cur.append(int(i))
        if cur:
            self.batches.append(cur)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        b = self.batches
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            b = [b[i] for i in torch.randperm(len(b), generator=g).tolist()]
        if self.pad and len(b) % self.num_replicas:
            b = b + b[: self.num_replicas - len(b) % self.num_replicas]
        return iter(b[self.rank::self.num_replicas])

    def __len__(self):
        n = len(self.batches)
        return -(-n // self.num_replicas) if self.pad else len(range(self.rank, n, self.num_replicas))


class ByteNetBlock(nn.Module):
    def __init__(self, d, dilation, k=5):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d // 2), nn.LayerNorm(d // 2)
        self.down = nn.Linear(d, d // 2)
        self.conv = nn.Conv1d(d // 2, d // 2, k, dilation=dilation, padding=dilation * (k - 1) // 2)
        self.up = nn.Linear(d // 2, d)

    def forward(self, x, mask):
        h = self.down(F.gelu(self.ln1(x)))
        h = F.gelu(self.ln2(h)).masked_fill(~mask[..., None], 0.0)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return x + self.up(F.gelu(self.ln3(h)))


class StabilityRegressor(nn.Module):
    def __init__(self, d=512, n_blocks=16):
        super().__init__()
        self.emb = nn.Embedding(len(VOCAB) + 1, d, padding_idx=0)
        self.blocks = nn.ModuleList(ByteNetBlock(d, 2 ** (i % 5)) for i in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(0.1), nn.Linear(d, 1))

    def forward(self, x, lens):
        mask = torch.arange(x.size(1), device=x.device)[None] < lens[:, None]
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h, mask)
        h = self.norm(h).masked_fill(~mask[..., None], 0.0)
        return self.head(h.sum(1) / lens[:, None]).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device, n_total):
    """Predictions for this rank's share, merged over ranks by example index."""
    model.eval()
    preds = torch.zeros(n_total, device=device)
    seen = torch.zeros(n_total, device=device)
    for x, lens, _, idx in loader:
        idx = idx.to(device)
        preds[idx] = model(x.to(device), lens.to(device)).float()
        seen[idx] = 1.0
    dist.all_reduce(preds)
    dist.all_reduce(seen)
    model.train()
    return (preds / seen.clamp(min=1)).cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    splits = {s: StabilityData(os.path.join(args.data_dir, f"{s}.csv")) for s in ("train", "valid", "test")}
    train_sampler = DistributedTokenBatchSampler(splits["train"].lengths, args.max_tokens, world, rank, seed=args.seed)
    loaders = {"train": DataLoader(splits["train"], batch_sampler=train_sampler, collate_fn=collate,
                                   num_workers=4, pin_memory=True)}
    for s in ("valid", "test"):
        smp = DistributedTokenBatchSampler(splits[s].lengths, args.max_tokens, world, rank, shuffle=False, pad=False)
        loaders[s] = DataLoader(splits[s], batch_sampler=smp, collate_fn=collate, num_workers=2)

    y_mean, y_std = float(splits["train"].y.mean()), float(splits["train"].y.std())
    model = DDP(StabilityRegressor().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(train_sampler))
    best_path = os.path.join(args.out, "best.pt")

    best_rho = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, lens, y, _ in loaders["train"]:
            x, lens, y = x.to(device), lens.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, lens).float()
            loss = F.mse_loss(pred, (y - y_mean) / y_std)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

        valid_pred = predict(model.module, loaders["valid"], device, len(splits["valid"]))
        rho = spearmanr(valid_pred, splits["valid"].y).correlation
        if rank == 0:
            print(f"epoch {epoch}: last loss {loss.item():.4f}  valid spearman {rho:.4f}", flush=True)
            if rho > best_rho:
                best_rho = rho
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "rho": rho,
                            "y_mean": y_mean, "y_std": y_std}, best_path)
        dist.barrier()

    # reload the best checkpoint into a plain model and score the test split
    ckpt = torch.load(best_path, map_location=device)
    final = StabilityRegressor().to(device)
    final.load_state_dict(ckpt["model"])
    test_pred = predict(final, loaders["test"], device, len(splits["test"]))
    test_rho = spearmanr(test_pred, splits["test"].y).correlation
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} (valid {ckpt['rho']:.4f}) -> test spearman {test_rho:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
