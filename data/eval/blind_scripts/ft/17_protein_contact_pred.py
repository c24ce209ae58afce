"""Residue-residue contact prediction: sequence transformer + pairwise 2D ResNet head.

Pair features are L x L, so the batch budget counts sum(L^2) rather than tokens.

    torchrun --nproc_per_node=8 17_protein_contact_pred.py --train-list data/pdb_train.txt \
        --valid-list data/casp_valid.txt --npz-dir data/npz --out runs/contact_v2
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

AA = "ACDEFGHIKLMNPQRSTVWY"
AA_IDX = {a: i + 1 for i, a in enumerate(AA)}  # 0 = pad / unknown


class ContactDataset(Dataset):
    """Each chain is an .npz with 'seq' (str) and 'cb' (L x 3 C-beta coordinates, NaN where missing)."""

    def __init__(self, list_file, npz_dir, max_len):
        with open(list_file) as f:
            self.ids = [l.split()[0] for l in f if l.strip()]
        lens = {}
        with open(list_file) as f:
            for l in f:
                if l.strip():
                    pid, n = l.split()[:2]
                    lens[pid] = min(int(n), max_len)
        self.lengths = [lens[p] for p in self.ids]
        self.npz_dir, self.max_len = npz_dir, max_len

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        z = np.load(os.path.join(self.npz_dir, self.ids[i] + ".npz"))
        seq, cb = str(z["seq"])[: self.max_len], z["cb"][: self.max_len]
        tokens = torch.tensor([AA_IDX.get(a, 0) for a in seq])
        d = np.linalg.norm(cb[:, None] - cb[None], axis=-1)
        contact = torch.from_numpy((d < 8.0).astype(np.float32))
        valid = torch.from_numpy(~np.isnan(d))
        return tokens, contact, valid


def collate(batch):
    L = max(t.size(0) for t, _, _ in batch)
    B = len(batch)
    tokens = torch.zeros(B, L, dtype=torch.long)
    contacts = torch.zeros(B, L, L)
    valid = torch.zeros(B, L, L, dtype=torch.bool)
    lens = torch.zeros(B, dtype=torch.long)
    for i, (t, c, v) in enumerate(batch):
        n = t.size(0)
        tokens[i, :n], contacts[i, :n, :n], valid[i, :n, :n], lens[i] = t, c, v, n
    return tokens, contacts, valid, lens


class PairBudgetSampler(Sampler):
    def __init__(self, lengths, max_pairs, num_replicas, rank, shuffle=True, seed=0, pad=True):
        self.lengths, self.max_pairs = np.asarray(lengths), max_pairs
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.pad, self.epoch = shuffle, seed, pad, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        order = np.argsort(self.lengths, kind="stable")
        batches, cur = [], []
        for i in order:
            L = int(self.lengths[i])
            if cur and (len(cur) + 1) * L * L > self.max_pairs:
                batches.append(cur)
                cur = []
            cur.append(int(i))
        if cur:
            batches.append(cur)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        if self.pad and len(batches) % self.num_replicas:
            batches += batches[: self.num_replicas - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class ResBlock2d(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.n1, self.n2 = nn.InstanceNorm2d(c, affine=True), nn.InstanceNorm2d(c, affine=True)
        self.c1 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)
        self.c2 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)

    def forward(self, x):
        h = self.c1(F.elu(self.n1(x)))
        return x + self.c2(F.elu(self.n2(h)))


class ContactNet(nn.Module):
    def __init__(self, d=384, layers=8, heads=8, pair_c=64, blocks=16, max_len=1024):
        super().__init__()
        self.emb = nn.Embedding(len(AA) + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.left, self.right = nn.Linear(d, pair_c), nn.Linear(d, pair_c)
        self.pair_in = nn.Conv2d(2 * pair_c, pair_c, 1)
        self.resnet = nn.Sequential(*[ResBlock2d(pair_c, 2 ** (i % 4)) for i in range(blocks)])
        self.out = nn.Conv2d(pair_c, 1, 1)

    def forward(self, tokens, lens):
        L = tokens.size(1)
        pad = torch.arange(L, device=tokens.device)[None] >= lens[:, None]
        h = self.encoder(self.emb(tokens) + self.pos.weight[:L], src_key_padding_mask=pad)
        a, b = self.left(h), self.right(h)
        pair = torch.cat([a[:, :, None].expand(-1, -1, L, -1), b[:, None].expand(-1, L, -1, -1)], -1)
        x = self.resnet(self.pair_in(pair.permute(0, 3, 1, 2)))
        logits = self.out(x).squeeze(1)
        return 0.5 * (logits + logits.transpose(1, 2))


def pair_mask(valid, min_sep=6):
    L = valid.size(-1)
    idx = torch.arange(L, device=valid.device)
    return valid & ((idx[None, :] - idx[:, None]).abs() >= min_sep)[None]


@torch.no_grad()
def precision_at_L5(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for tokens, contacts, valid, lens in loader:
        tokens, contacts, valid, lens = tokens.to(device), contacts.to(device), valid.to(device), lens.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, lens).float()
        m = pair_mask(valid, min_sep=24)
        for i in range(tokens.size(0)):
            k = max(1, int(lens[i]) // 5)
            scores = logits[i][m[i]]
            if scores.numel() == 0:
                continue
            top = scores.topk(min(k, scores.numel())).indices
            acc[0] += contacts[i][m[i]][top].mean()
            acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--valid-list", required=True)
    ap.add_argument("--npz-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--max-pairs", type=int, default=1_500_000)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds = ContactDataset(args.train_list, args.npz_dir, args.max_len)
    valid_ds = ContactDataset(args.valid_list, args.npz_dir, args.max_len)
    train_sampler = PairBudgetSampler(train_ds.lengths, args.max_pairs, world, rank, seed=args.seed)
    valid_sampler = PairBudgetSampler(valid_ds.lengths, args.max_pairs, world, rank, shuffle=False, pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=6, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler, collate_fn=collate, num_workers=2)

    model = DDP(ContactNet(max_len=args.max_len).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        skipped = 0
        for step, (tokens, contacts, valid, lens) in enumerate(train_loader):
            tokens, contacts = tokens.to(device, non_blocking=True), contacts.to(device, non_blocking=True)
            valid, lens = valid.to(device, non_blocking=True), lens.to(device, non_blocking=True)
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens, lens).float()
                m = pair_mask(valid)
                loss = F.binary_cross_entropy_with_logits(logits[m], contacts[m], pos_weight=torch.tensor(5.0, device=device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            except torch.cuda.OutOfMemoryError:
                skipped += 1
                print(f"[rank {rank}] OOM at L={tokens.size(1)} B={tokens.size(0)}, skipping batch", flush=True)
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_sampler)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        p_l5 = precision_at_L5(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: long-range P@L/5 {p_l5:.4f} (skipped {skipped} batches on rank 0)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if p_l5 > best:
                best = p_l5
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
