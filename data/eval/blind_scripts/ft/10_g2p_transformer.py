"""Grapheme-to-phoneme transformer trained on a pronunciation lexicon.

Words are short and very uneven in length, so batches are formed by a token budget over
length buckets.

    torchrun --nproc_per_node=2 10_g2p_transformer.py --lexicon data/cmudict.train \
        --dev-lexicon data/cmudict.dev --out exp/g2p_tf
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)


def read_lexicon(path):
    entries = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip() or line.startswith(";;;"):
                continue
            word, *phones = line.split()
            entries.append((word.split("(")[0].lower(), phones))
    return entries


def build_vocabs(entries):
    graphemes, phonemes = set(), set()
    for word, phones in entries:
        graphemes.update(word)
        phonemes.update(phones)
    g2i = {g: i for i, g in enumerate(SPECIALS + list(graphemes))}
    p2i = {p: i for i, p in enumerate(SPECIALS + list(phonemes))}
    return g2i, p2i


class LexiconDataset(Dataset):
    def __init__(self, entries, g2i, p2i):
        self.data = [([g2i.get(c, UNK) for c in w], [p2i.get(p, UNK) for p in ph]) for w, ph in entries]
        self.lengths = [max(len(s), len(t) + 1) for s, t in self.data]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def collate(batch):
    src = [torch.tensor(s) for s, _ in batch]
    tgt_in = [torch.tensor([BOS] + t) for _, t in batch]
    tgt_out = [torch.tensor(t + [EOS]) for _, t in batch]
    pad = lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=PAD)
    return pad(src), pad(tgt_in), pad(tgt_out)


class BucketTokenSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, even=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.even, self.epoch = shuffle, seed, even, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rnd = random.Random(self.seed + self.epoch)
        by_len = {}
        for i, n in enumerate(self.lengths):
            by_len.setdefault(n, []).append(i)
        batches = []
        for n in sorted(by_len):
            ids = by_len[n]
            if self.shuffle:
                rnd.shuffle(ids)
            per = max(1, self.max_tokens // n)
            batches += [ids[k:k + per] for k in range(0, len(ids), per)]
        if self.shuffle:
            rnd.shuffle(batches)
        if self.even and len(batches) % self.num_replicas:
            batches += batches[: self.num_replicas - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class G2PTransformer(nn.Module):
    def __init__(self, n_graph, n_phone, d=256, heads=4, enc_layers=4, dec_layers=4, max_len=64):
        super().__init__()
        self.src_emb = nn.Embedding(n_graph, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(n_phone, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.tf = nn.Transformer(d, heads, enc_layers, dec_layers, 4 * d, 0.2, batch_first=True)
        self.out = nn.Linear(d, n_phone)

    def embed(self, emb, x):
        return emb(x) * math.sqrt(emb.embedding_dim) + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt_in):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.tf(self.embed(self.src_emb, src), self.embed(self.tgt_emb, tgt_in), tgt_mask=causal,
                    src_key_padding_mask=src.eq(PAD), tgt_key_padding_mask=tgt_in.eq(PAD),
                    memory_key_padding_mask=src.eq(PAD))
        return self.out(h)

    @torch.no_grad()
    def greedy(self, src, max_len=40):
        memory = self.tf.encoder(self.embed(self.src_emb, src), src_key_padding_mask=src.eq(PAD))
        ys = torch.full((src.size(0), 1), BOS, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            causal = nn.Transformer.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.tf.decoder(self.embed(self.tgt_emb, ys), memory, tgt_mask=causal,
                                memory_key_padding_mask=src.eq(PAD))
            nxt = self.out(h[:, -1]).argmax(-1)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(EOS)
            if done.all():
                break
        return ys[:, 1:]


def strip(seq):
    out = []
    for t in seq:
        if t == EOS:
            break
        if t != PAD:
            out.append(t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lexicon", required=True)
    ap.add_argument("--dev-lexicon", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_entries = read_lexicon(args.lexicon)
    dev_entries = read_lexicon(args.dev_lexicon)
    g2i, p2i = build_vocabs(train_entries)
    i2p = {i: p for p, i in p2i.items()}

    train_ds, dev_ds = LexiconDataset(train_entries, g2i, p2i), LexiconDataset(dev_entries, g2i, p2i)
    train_sampler = BucketTokenSampler(train_ds.lengths, args.max_tokens, world, rank, seed=args.seed)
    dev_sampler = BucketTokenSampler(dev_ds.lengths, args.max_tokens, world, rank, shuffle=False, even=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=2)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=1)

    model = DDP(G2PTransformer(len(g2i), len(p2i)).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=3)

    best_per = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for src, tgt_in, tgt_out in train_loader:
            src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)
            logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD, label_smoothing=0.1)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

        # phone error rate and word error rate on dev, summed over ranks
        net = model.module
        net.eval()
        stats = torch.zeros(4, device=device)  # phone edits, ref phones, word errors, words
        for src, _, tgt_out in dev_loader:
            hyp = net.greedy(src.to(device)).tolist()
            for h, r in zip(hyp, tgt_out.tolist()):
                h, r = strip(h), strip(r)
                d = torchaudio.functional.edit_distance(h, r)
                stats += torch.tensor([d, len(r), float(d > 0), 1.0], device=device)
        dist.all_reduce(stats)
        dist.all_reduce(loss_sum)
        per, wer = (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()
        scheduler.step(per)
        if rank == 0:
            print(f"epoch {epoch:3d} train loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"dev PER {100 * per:.2f} WER {100 * wer:.2f} lr {optimizer.param_groups[0]['lr']:.1e}",
                  flush=True)
            if per < best_per:
                best_per = per
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": net.state_dict(), "g2i": g2i, "p2i": p2i, "i2p": i2p},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
