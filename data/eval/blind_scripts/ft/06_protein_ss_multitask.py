"""Continued pretraining of a protein encoder with masked-LM plus an auxiliary 3-state
secondary-structure loss on the residues that have DSSP annotation (a minority of chains).

torchrun --nproc_per_node=8 06_protein_ss_multitask.py --fasta data/pdb_seqres_clustered.fasta \
    --dssp data/dssp_ss3.tsv --val-fasta data/cameo_val.fasta --out runs/mlm_ss3
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

ALPHABET = "ACDEFGHIKLMNPQRSTVWYX"
PAD_IDX, MASK_IDX, CLS_IDX = 0, 1, 2
AA_TO_ID = {a: i + 3 for i, a in enumerate(ALPHABET)}
SS3 = {"H": 0, "E": 1, "C": 2}


def parse_fasta(path):
    records, name, buf = [], None, []
    with open(path) as fh:
        for line in fh:
            line = line.rstrip()
            if line.startswith(">"):
                if name is not None:
                    records.append((name, "".join(buf)))
                name, buf = line[1:].split()[0], []
            else:
                buf.append(line)
    if name is not None:
        records.append((name, "".join(buf)))
    return records


def load_dssp(path):
    table = {}
    with open(path) as fh:
        for line in fh:
            pid, ss = line.rstrip("\n").split("\t")
            table[pid] = ss
    return table


class ChainDataset(Dataset):
    def __init__(self, records, dssp, max_len):
        self.items = []
        for pid, seq in records:
            ss = dssp.get(pid)
            if ss is not None and len(ss) != len(seq):
                ss = None
            self.items.append((seq[:max_len], None if ss is None else ss[:max_len]))
        self.lengths = [len(s) + 1 for s, _ in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, ss = self.items[i]
        ids = torch.tensor([CLS_IDX] + [AA_TO_ID.get(a, AA_TO_ID["X"]) for a in seq])
        ss_ids = torch.full((len(ids),), -100, dtype=torch.long)
        if ss is not None:
            ss_ids[1:] = torch.tensor([SS3.get(c, 2) for c in ss])
        return ids, ss_ids


def mlm_collate(batch, mask_prob=0.15):
    ids, ss = zip(*batch)
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=PAD_IDX)
    ss = nn.utils.rnn.pad_sequence(ss, batch_first=True, padding_value=-100)
    can_mask = ids > CLS_IDX
    mask = (torch.rand(ids.shape) < mask_prob) & can_mask
    mlm_labels = torch.where(mask, ids, torch.full_like(ids, -100))
    inputs = ids.masked_fill(mask, MASK_IDX)
    return inputs, mlm_labels, ss, ids.eq(PAD_IDX)


class DistributedLengthBucketSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, seed=0, shuffle=True, pad=True):
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.pad = seed, shuffle, pad
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        idx = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        out, cur = [], []
        for i in idx:
            if cur and self.lengths[i] * (len(cur) + 1) > self.max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
        if self.shuffle:
            out = [out[j] for j in torch.randperm(len(out), generator=g).tolist()]
        if self.pad and len(out) % self.num_replicas:
            out = out + out[: self.num_replicas - len(out) % self.num_replicas]
        return out[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.batches())


class ProteinEncoder(nn.Module):
    def __init__(self, vocab=len(ALPHABET) + 3, dim=640, layers=16, heads=16, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=PAD_IDX)
        self.pos = nn.Embedding(max_len + 1, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.mlm_head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim), nn.Linear(dim, vocab))
        self.ss_head = nn.Sequential(nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, 3))

    def forward(self, ids, pad_mask):
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        h = self.norm(self.layers(h, src_key_padding_mask=pad_mask))
        return self.mlm_head(h), self.ss_head(h)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)  # mlm nll sum, mlm count, ss correct, ss count
    for inputs, mlm_labels, ss, pad in loader:
        inputs, mlm_labels, ss, pad = (t.to(device) for t in (inputs, mlm_labels, ss, pad))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mlm_logits, ss_logits = model(inputs, pad)
        acc[0] += F.cross_entropy(mlm_logits.float().transpose(1, 2), mlm_labels, reduction="sum")
        acc[1] += (mlm_labels != -100).sum()
        has = ss != -100
        acc[2] += (ss_logits.argmax(-1)[has] == ss[has]).sum()
        acc[3] += has.sum()
    dist.all_reduce(acc)
    model.train()
    return math.exp((acc[0] / acc[1]).item()), (acc[2] / acc[3].clamp(min=1)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fasta", required=True)
    p.add_argument("--dssp", required=True)
    p.add_argument("--val-fasta", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default=None, help="pretrained encoder weights")
    p.add_argument("--max-len", type=int, default=1022)
    p.add_argument("--max-tokens", type=int, default=12288)
    p.add_argument("--ss-weight", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=17)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    dssp = load_dssp(args.dssp)
    train_ds = ChainDataset(parse_fasta(args.fasta), dssp, args.max_len)
    val_ds = ChainDataset(parse_fasta(args.val_fasta), dssp, args.max_len)
    train_sampler = DistributedLengthBucketSampler(train_ds.lengths, args.max_tokens, world, rank, seed=args.seed)
    val_sampler = DistributedLengthBucketSampler(val_ds.lengths, args.max_tokens, world, rank, shuffle=False,
                                                 pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=mlm_collate, num_workers=6,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_sampler=val_sampler, collate_fn=mlm_collate, num_workers=2)

    model = ProteinEncoder(max_len=args.max_len + 1)
    if args.init:
        state = torch.load(args.init, map_location="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"loaded {args.init}: missing={missing} unexpected={unexpected}")
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_sampler)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / total))

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for inputs, mlm_labels, ss, pad in train_loader:
            inputs, mlm_labels, ss, pad = (t.to(device, non_blocking=True) for t in (inputs, mlm_labels, ss, pad))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                mlm_logits, ss_logits = model(inputs, pad)
            loss = F.cross_entropy(mlm_logits.float().transpose(1, 2), mlm_labels)
            ss_loss = torch.zeros((), device=device)
            if (ss != -100).any():
                ss_loss = F.cross_entropy(ss_logits.float().transpose(1, 2), ss)
                loss = loss + args.ss_weight * ss_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}:{step}] loss={loss.item():.4f} ss={ss_loss.item():.4f} "
                      f"lr={scheduler.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)

        ppl, q3 = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val MLM ppl {ppl:.3f}  SS Q3 {q3:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f"encoder_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
