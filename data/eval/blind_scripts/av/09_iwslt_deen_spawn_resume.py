"""IWSLT'14 De->En, transformer_iwslt_de_en sized model, single node, mp.spawn.

Data is BPE'd text produced by the usual prepare-iwslt14.sh (train/valid/test.{de,en}) plus
fairseq-style dictionaries dict.de.txt / dict.en.txt.

    python 09_iwslt_deen_spawn_resume.py --data data/iwslt14.tokenized.de-en --save-dir ckpt/iwslt
    python 09_iwslt_deen_spawn_resume.py --data data/iwslt14.tokenized.de-en --save-dir ckpt/iwslt \
        --restore-file ckpt/iwslt/checkpoint_last.pt
"""
import argparse
import math
import os
import random

import sacrebleu
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, EOS, UNK, BOS = "<pad>", "</s>", "<unk>", "<s>"


class Dictionary:
    def __init__(self, path):
        self.symbols = [BOS, PAD, EOS, UNK]
        with open(path) as f:
            for line in f:
                self.symbols.append(line.rsplit(" ", 1)[0])
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.bos, self.pad, self.eos, self.unk = 0, 1, 2, 3

    def __len__(self):
        return len(self.symbols)

    def encode(self, line):
        return [self.index.get(w, self.unk) for w in line.split()] + [self.eos]

    def string(self, ids):
        words = [self.symbols[i] for i in ids if i not in (self.bos, self.pad, self.eos)]
        return " ".join(words).replace("@@ ", "").replace("@@", "")


def load_split(data, split, sd, td, max_pos):
    with open(os.path.join(data, f"{split}.de")) as fs, open(os.path.join(data, f"{split}.en")) as ft:
        out = []
        for s, t in zip(fs, ft):
            s, t = sd.encode(s.strip()), td.encode(t.strip())
            if len(s) <= max_pos and len(t) <= max_pos:
                out.append((s, t))
    return out


def make_batches(data, max_tokens):
    order = sorted(range(len(data)), key=lambda i: (len(data[i][0]), len(data[i][1])))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_new = max(longest, len(data[i][0]), len(data[i][1]))
        if cur and longest_new * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest_new = [], max(len(data[i][0]), len(data[i][1]))
        cur.append(i)
        longest = longest_new
    if cur:
        batches.append(cur)
    return batches


def to_tensor(data, idx, pad, eos, device):
    src = [torch.tensor(data[i][0]) for i in idx]
    tgt = [torch.tensor(data[i][1]) for i in idx]
    prev = [torch.cat([torch.tensor([eos]), t[:-1]]) for t in tgt]  # fairseq: prev output starts with </s>
    p = lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=pad).to(device)
    return p(src), p(prev), p(tgt)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, pad, d=512, ffn=1024, heads=4, layers=6, dropout=0.3, max_pos=1024):
        super().__init__()
        self.pad, self.d = pad, d
        self.src_embed = nn.Embedding(src_vocab, d, padding_idx=pad)
        self.tgt_embed = nn.Embedding(tgt_vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(max_pos, d)
        self.core = nn.Transformer(d, heads, layers, layers, ffn, dropout, batch_first=True)
        self.out = nn.Linear(d, tgt_vocab, bias=False)
        self.out.weight = self.tgt_embed.weight
        self.drop = nn.Dropout(dropout)

    def emb(self, table, x):
        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        return self.drop(table(x) * math.sqrt(self.d) + self.pos(positions))

    def forward(self, src, prev):
        causal = self.core.generate_square_subsequent_mask(prev.size(1), device=prev.device)
        h = self.core(self.emb(self.src_embed, src), self.emb(self.tgt_embed, prev), tgt_mask=causal,
                      src_key_padding_mask=src.eq(self.pad), tgt_key_padding_mask=prev.eq(self.pad),
                      memory_key_padding_mask=src.eq(self.pad))
        return self.out(h)


def ls_loss(logits, target, eps, pad):
    lp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    nll = F.nll_loss(lp.view(-1, lp.size(-1)), target.view(-1), ignore_index=pad, reduction="sum")
    smooth = -lp.sum(-1).masked_fill(target.eq(pad), 0.0).sum()
    return (1 - eps) * nll + eps / lp.size(-1) * smooth, nll


@torch.no_grad()
def greedy(model, src, td, max_len=200):
    ys = torch.full((src.size(0), 1), td.eos, dtype=torch.long, device=src.device)
    for _ in range(max_len):
        nxt = model(src, ys)[:, -1].argmax(-1, keepdim=True)
        ys = torch.cat([ys, nxt], dim=1)
        if (ys == td.eos)[:, 1:].any(1).all():
            break
    return ys[:, 1:].tolist()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    sd = Dictionary(os.path.join(args.data, "dict.de.txt"))
    td = Dictionary(os.path.join(args.data, "dict.en.txt"))
    train = load_split(args.data, "train", sd, td, 1024)
    valid = load_split(args.data, "valid", sd, td, 1024)
    train_batches = make_batches(train, args.max_tokens)
    valid_batches = make_batches(valid, args.max_tokens)

    model = Seq2SeqTransformer(len(sd), len(td), td.pad).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-4)
    warmup = args.warmup_updates
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min((n + 1) / warmup, math.sqrt(warmup / (n + 1))))
    start_epoch, best_bleu = 1, 0.0
    if args.restore_file and os.path.exists(args.restore_file):
        ckpt = torch.load(args.restore_file)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch, best_bleu = ckpt["epoch"] + 1, ckpt.get("best_bleu", 0.0)
        if rank == 0:
            print(f"| loaded {args.restore_file} (epoch {ckpt['epoch']})")
    model = DDP(model, device_ids=[rank])

    for epoch in range(start_epoch, args.max_epoch + 1):
        model.train()
        batches = list(train_batches)
        random.Random(args.seed + epoch).shuffle(batches)
        per_rank = len(batches) // world_size  # drop the ragged tail so every rank steps equally
        mine = batches[rank * per_rank:(rank + 1) * per_rank]
        agg = torch.zeros(3, device=device)
        for i, idx in enumerate(mine):
            src, prev, tgt = to_tensor(train, idx, td.pad, td.eos, device)
            loss, nll = ls_loss(model(src, prev), tgt, args.label_smoothing, td.pad)
            ntok = tgt.ne(td.pad).sum()
            optimizer.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            if args.clip_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            optimizer.step()
            scheduler.step()
            agg += torch.stack([loss.detach(), nll.detach(), ntok.float()])
        dist.all_reduce(agg)

        # validation: greedy BLEU over the full valid set, shards gathered to rank 0
        model.eval()
        hyps = []
        for idx in valid_batches[rank::world_size]:
            src, _, _ = to_tensor(valid, idx, td.pad, td.eos, device)
            for i, h in zip(idx, greedy(model.module, src, td)):
                hyps.append((i, td.string(h)))
        gathered = [None] * world_size
        dist.all_gather_object(gathered, hyps)
        if rank == 0:
            merged = dict(x for part in gathered for x in part)
            sys = [merged[i] for i in range(len(valid))]
            refs = [td.string(t) for _, t in valid]
            bleu = sacrebleu.corpus_bleu(sys, [refs], tokenize="none").score
            print(f"| epoch {epoch:03d} | loss {agg[0] / agg[2] / math.log(2):.3f} | nll {agg[1] / agg[2] / math.log(2):.3f}"
                  f" | valid bleu {bleu:.2f} | lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            best_bleu = max(best_bleu, bleu)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "best_bleu": best_bleu}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if bleu >= best_bleu:
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", dest="save_dir", default="checkpoints/iwslt14_de_en")
    p.add_argument("--restore-file", dest="restore_file", default=None)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=4096)
    p.add_argument("--max-epoch", dest="max_epoch", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-updates", dest="warmup_updates", type=int, default=4000)
    p.add_argument("--label-smoothing", dest="label_smoothing", type=float, default=0.1)
    p.add_argument("--clip-norm", dest="clip_norm", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size)


if __name__ == "__main__":
    main()
