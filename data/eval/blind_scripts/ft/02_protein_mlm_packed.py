"""Masked-LM pretraining of a small protein language model on packed sequences.

Sequences of different length are packed end to end into one flat row per step
(no padding) and attention is kept inside each sequence with flash-attn's varlen kernel.

    torchrun --nproc_per_node=8 02_protein_mlm_packed.py --train uniref50_train.fasta \
        --valid uniref50_valid.fasta --out runs/pmlm_35m
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

AA = list("LAGVSERTIDPKQNFYMHWCXBUZO")
SPECIALS = ["<pad>", "<cls>", "<eos>", "<mask>"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + AA)}
PAD, CLS, EOS, MASK = (VOCAB[t] for t in SPECIALS)


def read_fasta(path, max_len):
    seqs, cur = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur)[:max_len])
                cur = []
            elif line:
                cur.append(line)
    if cur:
        seqs.append("".join(cur)[:max_len])
    return seqs


class ProteinDataset(Dataset):
    def __init__(self, seqs):
        self.seqs = seqs
        self.lengths = [len(s) + 2 for s in seqs]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        ids = [CLS] + [VOCAB.get(a, VOCAB["X"]) for a in self.seqs[i]] + [EOS]
        return torch.tensor(ids, dtype=torch.long)


class DistributedPackSampler(Sampler):
    """Yields packs (lists of indices) whose total length is at most `tokens_per_pack`.
    The pack list is built identically on every rank from (seed, epoch), padded to a
    multiple of the world size, and then split between ranks."""

    def __init__(self, lengths, tokens_per_pack, num_replicas, rank, shuffle=True, seed=0, pad_to_even=True):
        self.lengths = lengths
        self.tokens_per_pack = tokens_per_pack
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.pad_to_even = pad_to_even
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def packs(self):
        order = list(range(len(self.lengths)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        packs, cur, cur_tokens = [], [], 0
        for i in order:
            n = self.lengths[i]
            if cur and cur_tokens + n > self.tokens_per_pack:
                packs.append(cur)
                cur, cur_tokens = [], 0
            cur.append(i)
            cur_tokens += n
        if cur:
            packs.append(cur)
        if self.pad_to_even and len(packs) % self.num_replicas:
            packs += packs[: self.num_replicas - len(packs) % self.num_replicas]
        return packs[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.packs())

    def __len__(self):
        return len(self.packs())


class PackCollator:
    def __init__(self, mask_prob=0.15, generator_seed=None):
        self.mask_prob = mask_prob
        self.g = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)

    def __call__(self, seqs):
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        cu_seqlens = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        input_ids = torch.cat(seqs)
        position_ids = torch.cat([torch.arange(n) for n in lens.tolist()])
        labels = input_ids.clone()
        special = (input_ids == CLS) | (input_ids == EOS)
        probs = torch.rand(input_ids.shape, generator=self.g)
        selected = (probs < self.mask_prob) & ~special
        labels[~selected] = -100
        r = torch.rand(input_ids.shape, generator=self.g)
        input_ids = input_ids.clone()
        input_ids[selected & (r < 0.8)] = MASK
        rand_tok = selected & (r >= 0.8) & (r < 0.9)
        input_ids[rand_tok] = torch.randint(len(SPECIALS), len(VOCAB), (int(rand_tok.sum()),), generator=self.g)
        return input_ids, position_ids, cu_seqlens, int(lens.max()), labels


class VarlenBlock(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(self.ln1(x)).view(-1, 3, self.heads, self.head_dim).unbind(1)
        attn = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      dropout_p=self.dropout if self.training else 0.0)
        x = x + self.out(attn.reshape(x.size(0), -1))
        return x + self.mlp(self.ln2(x))


class ProteinLM(nn.Module):
    def __init__(self, dim=480, layers=12, heads=20, max_pos=1026, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_pos, dim)
        self.blocks = nn.ModuleList([VarlenBlock(dim, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, len(VOCAB), bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen):
        x = self.embed(input_ids) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x, cu_seqlens, max_seqlen)
        return self.lm_head(self.ln_f(x))


def to_device(batch, device):
    input_ids, position_ids, cu_seqlens, max_seqlen, labels = batch
    return (input_ids.to(device, non_blocking=True), position_ids.to(device, non_blocking=True),
            cu_seqlens.to(device, non_blocking=True), max_seqlen, labels.to(device, non_blocking=True))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        input_ids, position_ids, cu_seqlens, max_seqlen, labels = to_device(batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids, position_ids, cu_seqlens, max_seqlen)
        totals[0] += F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        totals[1] += (labels != -100).sum()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-per-pack", type=int, default=32768)
    ap.add_argument("--max-len", type=int, default=1022)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # only masking / dropout randomness; data order comes from the sampler

    train_ds = ProteinDataset(read_fasta(args.train, args.max_len))
    valid_ds = ProteinDataset(read_fasta(args.valid, args.max_len))
    train_sampler = DistributedPackSampler(train_ds.lengths, args.tokens_per_pack, world, rank, seed=args.seed)
    valid_sampler = DistributedPackSampler(valid_ds.lengths, args.tokens_per_pack, world, rank,
                                           shuffle=False, pad_to_even=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=PackCollator(),
                              num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler,
                              collate_fn=PackCollator(generator_seed=1234), num_workers=0)

    model = ProteinLM(max_pos=args.max_len + 4).to(device)
    start_epoch, step = 0, 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
    model = DDP(model, device_ids=[local_rank])

    total = args.epochs * len(train_sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))),
        last_epoch=step - 1)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            input_ids, position_ids, cu_seqlens, max_seqlen, labels = to_device(batch, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids, position_ids, cu_seqlens, max_seqlen)
            loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
            # Normalise by the number of masked tokens over all ranks; DDP averages the
            # gradients over ranks, so multiply the world size back in.
            n_masked = (labels != -100).sum().float()
            dist.all_reduce(n_masked)
            loss = loss_sum * world / n_masked.clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                local_loss = loss_sum.item() / max(1, int((labels != -100).sum()))
                print(f"ep {epoch} step {step} loss {local_loss:.4f} "
                      f"masked(all ranks) {int(n_masked.item())} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        val_loss = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s valid loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
