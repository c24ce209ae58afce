"""
Transformer-base NMT (WMT14 en-de, pre-binarized with sentencepiece ids).
Usage:
    python -m torch.distributed.launch --nproc_per_node=8 06_nmt_transformer.py \
        --data data-bin/wmt14_en_de --max_tokens 4096 --update_freq 2
"""
import os
import math
import time
import random
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, Sampler
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, BOS, EOS = 0, 1, 2

parser = argparse.ArgumentParser()
parser.add_argument('--data', default='data-bin/wmt14_en_de')
parser.add_argument('--local_rank', type=int, default=0)
parser.add_argument('--max_tokens', type=int, default=4096)
parser.add_argument('--update_freq', type=int, default=1)
parser.add_argument('--d_model', type=int, default=512)
parser.add_argument('--nhead', type=int, default=8)
parser.add_argument('--layers', type=int, default=6)
parser.add_argument('--ffn', type=int, default=2048)
parser.add_argument('--dropout', type=float, default=0.1)
parser.add_argument('--label_smoothing', type=float, default=0.1)
parser.add_argument('--lr', type=float, default=7e-4)
parser.add_argument('--warmup', type=int, default=4000)
parser.add_argument('--max_update', type=int, default=100000)
parser.add_argument('--save_interval', type=int, default=5000)
parser.add_argument('--save_dir', default='checkpoints/transformer_wmt_en_de')
parser.add_argument('--clip_norm', type=float, default=1.0)
parser.add_argument('--fp16', action='store_true')
args = parser.parse_args()


class PairDataset(Dataset):
    def __init__(self, path):
        d = torch.load(path)
        self.src, self.tgt = d['src'], d['tgt']
        self.vocab = d['vocab_size']

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i]

    def num_tokens(self, i):
        return max(len(self.src[i]), len(self.tgt[i]))


class DistributedBucketSampler(Sampler):
    """token-based batches, same number of batches on every rank."""

    def __init__(self, ds, max_tokens, rank, world, seed=1, pad=True):
        self.ds, self.max_tokens, self.rank, self.world, self.seed = ds, max_tokens, rank, world, seed
        self.pad = pad
        self.epoch = 0
        order = sorted(range(len(ds)), key=ds.num_tokens)
        self.batches, cur, cur_max = [], [], 0
        for i in order:
            n = ds.num_tokens(i)
            if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
                self.batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, n)
        if cur:
            self.batches.append(cur)

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        b = list(self.batches)
        rng.shuffle(b)
        if self.pad:
            b += b[:(self.world - len(b) % self.world) % self.world]
        return iter(b[self.rank::self.world])

    def __len__(self):
        if self.pad:
            return math.ceil(len(self.batches) / self.world)
        return len(self.batches[self.rank::self.world])


def collate(samples):
    def pad(seqs, bos=False):
        L = max(len(s) for s in seqs) + (2 if bos else 1)
        out = torch.full((len(seqs), L), PAD, dtype=torch.long)
        for i, s in enumerate(seqs):
            s = ([BOS] if bos else []) + list(s) + [EOS]
            out[i, :len(s)] = torch.tensor(s)
        return out
    src = pad([s for s, _ in samples])
    tgt = pad([t for _, t in samples], bos=True)
    return src, tgt[:, :-1], tgt[:, 1:]


class PositionalEncoding(nn.Module):
    def __init__(self, d, maxlen=1024):
        super().__init__()
        pe = torch.zeros(maxlen, d)
        pos = torch.arange(maxlen).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer('pe', pe)

    def forward(self, x):
        return x + self.pe[:x.size(1)]


class TransformerNMT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(args.d_model)
        self.transformer = nn.Transformer(args.d_model, args.nhead, args.layers, args.layers, args.ffn,
                                          args.dropout, batch_first=True, norm_first=True)
        self.out = nn.Linear(args.d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale = math.sqrt(args.d_model)

    def forward(self, src, tgt_in):
        mask = self.transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        s = self.pos(self.embed(src) * self.scale)
        t = self.pos(self.embed(tgt_in) * self.scale)
        h = self.transformer(s, t, tgt_mask=mask, src_key_padding_mask=src.eq(PAD),
                             tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src.eq(PAD))
        return self.out(h)


def inverse_sqrt(step):
    step = max(step, 1)
    return min(step / args.warmup, math.sqrt(args.warmup / step))


def main():
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', args.local_rank)

    train = PairDataset(os.path.join(args.data, 'train.pt'))
    valid = PairDataset(os.path.join(args.data, 'valid.pt'))
    tr_sampler = DistributedBucketSampler(train, args.max_tokens, rank, world)
    va_sampler = DistributedBucketSampler(valid, args.max_tokens, rank, world, pad=False)
    tr_loader = DataLoader(train, batch_sampler=tr_sampler, collate_fn=collate, num_workers=2, pin_memory=True)
    va_loader = DataLoader(valid, batch_sampler=va_sampler, collate_fn=collate, num_workers=2)

    model = TransformerNMT(train.vocab).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print('params: %.1fM' % (sum(p.numel() for p in model.parameters()) / 1e6))

    num_updates, epoch = 0, 0
    while num_updates < args.max_update:
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (src, tgt_in, tgt_out) in enumerate(tr_loader):
            src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)
            last = (i + 1) % args.update_freq == 0
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                with torch.autocast('cuda', dtype=torch.float16, enabled=args.fp16):
                    logits = model(src, tgt_in)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt_out.reshape(-1),
                                           ignore_index=PAD, label_smoothing=args.label_smoothing)
                scaler.scale(loss / args.update_freq).backward()
            if not last:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            num_updates += 1
            if num_updates % 100 == 0 and rank == 0:
                print('epoch %d upd %d loss %.3f lr %.2e wps-ish %.1fs' % (
                    epoch, num_updates, loss.item(), sched.get_last_lr()[0], time.time() - t0), flush=True)
                t0 = time.time()
            if num_updates % args.save_interval == 0:
                vloss = validate(model, va_loader, device)
                if rank == 0:
                    print('| valid loss %.3f ppl %.2f' % (vloss, math.exp(vloss)))
                    torch.save({'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                                'num_updates': num_updates}, os.path.join(args.save_dir, 'checkpoint_last.pt'))
                model.train()
            if num_updates >= args.max_update:
                break
        epoch += 1
    dist.destroy_process_group()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for src, tgt_in, tgt_out in loader:
        src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)
        logits = model.module(src, tgt_in)
        tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt_out.reshape(-1),
                                  ignore_index=PAD, reduction='sum')
        tot[1] += tgt_out.ne(PAD).sum()
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


if __name__ == '__main__':
    main()
