"""Transformer-base NMT (IWSLT14 de-en, BPE'd with sentencepiece), plain PyTorch + DDP.

Token-based batching: sentences of similar length are bucketed, batches are capped
by --max_tokens, and the list of batches is dealt out to the GPUs.

    torchrun --nproc_per_node=4 19_transformer_nmt_buckets.py --data data/iwslt14.de-en --max_tokens 4096
"""
import argparse
import math
import os
import random
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

PAD, BOS, EOS = 0, 1, 2


class ParallelText(Dataset):
    def __init__(self, src_path, tgt_path, sp, max_len=256):
        with open(src_path) as fs, open(tgt_path) as ft:
            pairs = [(s.strip(), t.strip()) for s, t in zip(fs, ft)]
        self.src = [sp.encode(s)[:max_len] for s, _ in pairs]
        self.tgt = [[BOS] + sp.encode(t)[:max_len - 2] + [EOS] for _, t in pairs]
        self.raw_tgt = [t for _, t in pairs]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return torch.tensor(self.src[i]), torch.tensor(self.tgt[i]), i


def collate(batch):
    src = nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=PAD)
    tgt = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=PAD)
    return src, tgt, torch.tensor([b[2] for b in batch])


class DistributedBucketSampler(Sampler):
    """Yields lists of indices (batch_sampler). Batches are built identically on every
    rank from a shared seed, then rank r takes batches r, r+W, r+2W, ..."""

    def __init__(self, lengths, max_tokens, num_replicas, rank, seed=0, shuffle=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _make_batches(self):
        g = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], g.random()))
        batches, cur, cur_max = [], [], 0
        for i in order:
            m = max(cur_max, self.lengths[i])
            if cur and m * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, m = [], self.lengths[i]
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
        if self.shuffle:
            g.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._make_batches()[self.rank::self.num_replicas])

    def __len__(self):
        return len(self._make_batches()[self.rank::self.num_replicas])


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer('pe', pe, persistent=False)

    def forward(self, x):
        return x + self.pe[:x.size(1)]


class Seq2Seq(nn.Module):
    def __init__(self, vocab, d=512, heads=8, layers=6, ff=1024, drop=0.3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = PositionalEncoding(d)
        self.tf = nn.Transformer(d, heads, layers, layers, ff, drop, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.scale, self.drop = math.sqrt(d), nn.Dropout(drop)

    def embed(self, x):
        return self.drop(self.pos(self.emb(x) * self.scale))

    def forward(self, src, tgt_in):
        causal = self.tf.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.tf(self.embed(src), self.embed(tgt_in), tgt_mask=causal,
                    src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt_in == PAD,
                    memory_key_padding_mask=src == PAD)
        return self.out(h)

    @torch.no_grad()
    def greedy(self, src, max_len=200):
        mem = self.tf.encoder(self.embed(src), src_key_padding_mask=src == PAD)
        ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            causal = self.tf.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.tf.decoder(self.embed(ys), mem, tgt_mask=causal, memory_key_padding_mask=src == PAD)
            nxt = self.out(h[:, -1]).argmax(-1)
            nxt = nxt.masked_fill(done, PAD)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == EOS
            if done.all():
                break
        return ys


def inverse_sqrt(step, warmup, d=512):
    step = max(step, 1)
    return d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data', default='data/iwslt14.de-en')
    ap.add_argument('--spm', default='data/iwslt14.de-en/spm.model')
    ap.add_argument('--max_tokens', type=int, default=4096)
    ap.add_argument('--epochs', type=int, default=60)
    ap.add_argument('--warmup', type=int, default=4000)
    ap.add_argument('--lr_scale', type=float, default=1.0)
    ap.add_argument('--label_smoothing', type=float, default=0.1)
    ap.add_argument('--save_dir', default='checkpoints/iwslt_tf')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    train = ParallelText(os.path.join(args.data, 'train.de'), os.path.join(args.data, 'train.en'), sp)
    valid = ParallelText(os.path.join(args.data, 'valid.de'), os.path.join(args.data, 'valid.en'), sp)
    lengths = [max(len(s), len(t)) for s, t in zip(train.src, train.tgt)]
    bsampler = DistributedBucketSampler(lengths, args.max_tokens, world, rank, seed=1)
    train_dl = DataLoader(train, batch_sampler=bsampler, collate_fn=collate, num_workers=2, pin_memory=True)
    valid_dl = DataLoader(valid, batch_size=64, shuffle=False, collate_fn=collate)

    torch.manual_seed(1)
    model = Seq2Seq(sp.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: args.lr_scale * inverse_sqrt(s, args.warmup))

    writer = SummaryWriter(os.path.join(args.save_dir, 'tb')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    step, best_bleu = 0, -1.0
    for epoch in range(args.epochs):
        bsampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tok_loss = torch.zeros(2, device=device)
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
            logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1),
                                   ignore_index=PAD, label_smoothing=args.label_smoothing, reduction='sum')
            ntok = (tgt_out != PAD).sum()
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            tok_loss += torch.stack([loss.detach(), ntok.float()])
            if writer is not None and step % 100 == 0:
                writer.add_scalar('train/loss', (loss / ntok).item(), step)
                writer.add_scalar('train/lr', sched.get_last_lr()[0], step)
        dist.all_reduce(tok_loss)
        train_nll = (tok_loss[0] / tok_loss[1]).item()

        if rank == 0:
            net = model.module.eval()
            hyps, refs = [], []
            for src, _, idx in valid_dl:
                out = net.greedy(src.to(device))
                for row, i in zip(out.tolist(), idx.tolist()):
                    row = [t for t in row[1:] if t not in (PAD, EOS)]
                    hyps.append(sp.decode(row))
                    refs.append(valid.raw_tgt[i])
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            print(f'epoch {epoch} step {step} train loss {train_nll:.3f} valid BLEU {bleu:.2f} ({time.time() - t0:.0f}s)')
            writer.add_scalar('valid/bleu', bleu, epoch)
            ck = {'model': model.module.state_dict(), 'opt': opt.state_dict(), 'epoch': epoch, 'step': step}
            torch.save(ck, os.path.join(args.save_dir, 'checkpoint_last.pt'))
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(ck, os.path.join(args.save_dir, 'checkpoint_best.pt'))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
