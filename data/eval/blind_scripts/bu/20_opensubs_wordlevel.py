"""Word-level transformer NMT on OpenSubtitles2018 En->Es (Moses-tokenised, lowercased).

The corpus is ~60M lines, so each worker streams the file and keeps only
its own share of the lines in memory.

    torchrun --nproc_per_node=8 20_opensubs_wordlevel.py --train data/os18/train.tok --valid data/os18/dev.tok
"""
import argparse
import itertools
import math
import os
import time
from collections import Counter

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True, help="prefix, expects .en/.es")
    p.add_argument("--valid", required=True)
    p.add_argument("--out", default="checkpoints/os18_enes")
    p.add_argument("--min-freq", type=int, default=5)
    p.add_argument("--max-len", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=8000)
    p.add_argument("--max-update", type=int, default=200000)
    p.add_argument("--valid-every", type=int, default=5000)
    return p.parse_args()


class Vocab:
    def __init__(self, itos):
        self.itos = itos
        self.stoi = {w: i for i, w in enumerate(itos)}

    @classmethod
    def build(cls, sentences, min_freq):
        c = Counter(w for s in sentences for w in s)
        return cls(SPECIALS + sorted(w for w, n in c.items() if n >= min_freq))

    def ids(self, words):
        return [self.stoi.get(w, UNK) for w in words]

    def words(self, ids):
        return " ".join(self.itos[i] for i in ids if i >= UNK)

    def __len__(self):
        return len(self.itos)


def read_shard(prefix, rank, world, max_len):
    src, tgt = [], []
    with open(prefix + ".en", encoding="utf-8") as fe, open(prefix + ".es", encoding="utf-8") as fs:
        for en, es in itertools.islice(zip(fe, fs), rank, None, world):
            a, b = en.split(), es.split()
            if 0 < len(a) <= max_len and 0 < len(b) <= max_len:
                src.append(a)
                tgt.append(b)
    return src, tgt


class Encoded(Dataset):
    def __init__(self, src, tgt, sv, tv):
        self.x = [sv.ids(s) for s in src]
        self.y = [tv.ids(t) for t in tgt]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def collate(batch):
    S = max(len(x) for x, _ in batch) + 1
    T = max(len(y) for _, y in batch) + 1
    src = torch.full((len(batch), S), PAD)
    dec_in = torch.full((len(batch), T), PAD)
    dec_out = torch.full((len(batch), T), PAD)
    for i, (x, y) in enumerate(batch):
        src[i, : len(x) + 1] = torch.tensor(x + [EOS])
        dec_in[i, : len(y) + 1] = torch.tensor([BOS] + y)
        dec_out[i, : len(y) + 1] = torch.tensor(y + [EOS])
    return src, dec_in, dec_out


class WordNMT(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d=512, h=8, f=2048, n=6, p=0.1):
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(tgt_vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(256, d)
        self.tf = nn.Transformer(d, h, n, n, f, p, batch_first=True)
        self.drop = nn.Dropout(p)
        self.scale = math.sqrt(d)

    def _emb(self, table, x):
        return self.drop(table(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        return self.tf.encoder(self._emb(self.src_emb, src), src_key_padding_mask=src.eq(PAD))

    def decode(self, y, mem, src):
        T = y.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=y.device), 1)
        h = self.tf.decoder(self._emb(self.tgt_emb, y), mem, tgt_mask=causal, tgt_key_padding_mask=y.eq(PAD),
                            memory_key_padding_mask=src.eq(PAD))
        return F.linear(h, self.tgt_emb.weight)

    def forward(self, src, y):
        return self.decode(y, self.encode(src), src)


def ls_loss(logits, gold, eps=0.1):
    lp = F.log_softmax(logits.float(), -1)
    m = gold.ne(PAD)
    nll = -lp.gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    eps_i = eps / (lp.size(-1) - 1)
    return ((1 - eps - eps_i) * nll - eps_i * lp.sum(-1))[m].sum(), nll[m].sum(), m.sum()


@torch.no_grad()
def greedy(net, src, max_len):
    mem = net.encode(src)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    for _ in range(max_len):
        ys = torch.cat([ys, net.decode(ys, mem, src)[:, -1].argmax(-1, keepdim=True)], 1)
        if ys.eq(EOS).any(1).all():
            break
    return [r[: r.index(EOS)] if EOS in r else r for r in ys[:, 1:].tolist()]


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    t0 = time.time()
    src, tgt = read_shard(args.train, rank, world, args.max_len)
    src_vocab = Vocab.build(src, args.min_freq)
    tgt_vocab = Vocab.build(tgt, args.min_freq)
    train = Encoded(src, tgt, src_vocab, tgt_vocab)
    del src, tgt
    print(f"[rank {rank}] {len(train)} pairs, vocab {len(src_vocab)}/{len(tgt_vocab)}, "
          f"{time.time() - t0:.0f}s", flush=True)
    # every shard has (almost) the same size; fix the steps per epoch so all ranks agree
    n_min = torch.tensor([len(train)], device=device)
    dist.all_reduce(n_min, op=dist.ReduceOp.MIN)
    steps_per_epoch = n_min.item() // args.batch_size
    loader = DataLoader(train, batch_size=args.batch_size, sampler=RandomSampler(train), collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    net = WordNMT(len(src_vocab), len(tgt_vocab)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min((u + 1) / W, math.sqrt(W / (u + 1))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        vsrc, vtgt = read_shard(args.valid, 0, 1, 200)
        vsrc_ids = [src_vocab.ids(s) for s in vsrc]
        vrefs = [" ".join(t) for t in vtgt]

    updates = 0
    while updates < args.max_update:
        model.train()
        for step, (s, yi, yo) in enumerate(loader):
            if step >= steps_per_epoch:
                break
            s, yi, yo = s.to(device), yi.to(device), yo.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(s, yi)
            loss, nll, ntok = ls_loss(logits, yo)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            updates += 1
            if rank == 0 and updates % 200 == 0:
                print(f"upd {updates} nll {(nll / ntok).item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if updates % args.valid_every == 0:
                if rank == 0:
                    net.eval()
                    hyps = []
                    for k in range(0, len(vsrc_ids), 128):
                        chunk = vsrc_ids[k:k + 128]
                        x = torch.full((len(chunk), max(map(len, chunk)) + 1), PAD)
                        for i, ids in enumerate(chunk):
                            x[i, : len(ids) + 1] = torch.tensor(ids + [EOS])
                        hyps += [tgt_vocab.words(h) for h in greedy(net, x.to(device), 100)]
                    net.train()
                    bleu = sacrebleu.corpus_bleu(hyps, [vrefs], tokenize="none").score
                    print(f"upd {updates} | dev BLEU {bleu:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "src_vocab": src_vocab.itos, "tgt_vocab": tgt_vocab.itos,
                                "updates": updates}, os.path.join(args.out, f"checkpoint_{updates}.pt"))
                dist.barrier()
            if updates >= args.max_update:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
