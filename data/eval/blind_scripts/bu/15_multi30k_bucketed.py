"""Multi30k En->De small transformer with length-bucketed batches.

Trains for a fixed number of epochs, averages the last 5 epoch checkpoints
and reports test2016 BLEU with beam search.

    torchrun --nproc_per_node=2 15_multi30k_bucketed.py --data data/multi30k --epochs 40
"""
import argparse
import math
import os
import random

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


class Multi30k(Dataset):
    def __init__(self, root, split, sp):
        en = open(os.path.join(root, f"{split}.en"), encoding="utf-8").read().splitlines()
        de = open(os.path.join(root, f"{split}.de"), encoding="utf-8").read().splitlines()
        self.data = [(sp.encode(a), sp.encode(b), b) for a, b in zip(en, de)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class DistributedBucketSampler(Sampler):
    """Groups examples of similar length into batches and gives each rank an equal share."""

    def __init__(self, lengths, batch_size, num_replicas, rank, bucket_width=8, seed=0):
        self.lengths, self.batch_size = lengths, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.bucket_width, self.seed, self.epoch = bucket_width, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        buckets = {}
        for i, n in enumerate(self.lengths):
            buckets.setdefault(n // self.bucket_width, []).append(i)
        batches = []
        for key in sorted(buckets):
            ids = buckets[key]
            rng.shuffle(ids)
            batches += [ids[j:j + self.batch_size] for j in range(0, len(ids), self.batch_size)]
        rng.shuffle(batches)
        usable = len(batches) // self.num_replicas * self.num_replicas
        return batches[:usable]

    def __iter__(self):
        return iter(self._batches()[self.rank::self.num_replicas])

    def __len__(self):
        return len(self._batches()) // self.num_replicas


def collate(items, pad=0, bos=1, eos=2):
    S = max(len(a) for a, _, _ in items) + 1
    T = max(len(b) for _, b, _ in items) + 1
    src = torch.full((len(items), S), pad, dtype=torch.long)
    dec_in = torch.full((len(items), T), pad, dtype=torch.long)
    dec_out = torch.full((len(items), T), pad, dtype=torch.long)
    for i, (a, b, _) in enumerate(items):
        src[i, : len(a) + 1] = torch.tensor(a + [eos])
        dec_in[i, : len(b) + 1] = torch.tensor([bos] + b)
        dec_out[i, : len(b) + 1] = torch.tensor(b + [eos])
    return src, dec_in, dec_out, [r for _, _, r in items]


class SmallTransformer(nn.Module):
    def __init__(self, vocab, d=256, h=4, ffn=1024, n=3, p=0.3, pad=0):
        super().__init__()
        self.pad = pad
        self.emb = nn.Embedding(vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(256, d)
        self.core = nn.Transformer(d, h, n, n, ffn, p, batch_first=True)
        self.drop = nn.Dropout(p)
        self.d = d

    def _e(self, x):
        return self.drop(self.emb(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        return self.core.encoder(self._e(src), src_key_padding_mask=src.eq(self.pad))

    def decode(self, y, mem, src):
        causal = torch.triu(torch.ones(y.size(1), y.size(1), dtype=torch.bool, device=y.device), 1)
        h = self.core.decoder(self._e(y), mem, tgt_mask=causal, tgt_key_padding_mask=y.eq(self.pad),
                              memory_key_padding_mask=src.eq(self.pad))
        return h @ self.emb.weight.t()

    def forward(self, src, y):
        return self.decode(y, self.encode(src), src)


def smoothed_ce(logits, gold, eps=0.1, pad=0):
    lp = F.log_softmax(logits.float(), -1)
    m = gold.ne(pad)
    nll = -lp.gather(-1, gold.unsqueeze(-1)).squeeze(-1)[m]
    uni = -lp.mean(-1)[m]
    return ((1 - eps) * nll + eps * uni).sum(), nll.sum(), m.sum()


@torch.no_grad()
def beam_translate(net, src, k=5, max_len=60, bos=1, eos=2):
    B = src.size(0)
    mem = net.encode(src).repeat_interleave(k, 0)
    srck = src.repeat_interleave(k, 0)
    ys = torch.full((B * k, 1), bos, dtype=torch.long, device=src.device)
    sc = torch.zeros(B, k, device=src.device)
    sc[:, 1:] = -1e9
    done = torch.zeros(B * k, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(ys, mem, srck)[:, -1].float(), -1)
        lp[done] = -1e9
        lp[done, eos] = 0.0
        V = lp.size(-1)
        sc, ix = (sc.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        src_beam = (ix // V + torch.arange(B, device=src.device)[:, None] * k).view(-1)
        ys = torch.cat([ys[src_beam], (ix % V).reshape(-1, 1)], 1)
        done = done[src_beam] | ys[:, -1].eq(eos)
        if done.all():
            break
    L = (ys[:, 1:].ne(eos).sum(1) + 1).float().view(B, k)
    return ys.view(B, k, -1)[torch.arange(B), (sc / L).argmax(-1), 1:].tolist()


def corpus_bleu(net, ds, sp, device, eos=2):
    hyps, refs = [], []
    for start in range(0, len(ds), 100):
        src, _, _, ref = collate([ds[i] for i in range(start, min(start + 100, len(ds)))])
        for row in beam_translate(net, src.to(device)):
            hyps.append(sp.decode(row[: row.index(eos)] if eos in row else row))
        refs += ref
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/multi30k")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--avg-last", type=int, default=5)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm8k.model"))
    train = Multi30k(args.data, "train", sp)
    valid = Multi30k(args.data, "val", sp)
    test = Multi30k(args.data, "test2016", sp)
    lengths = [max(len(a), len(b)) for a, b, _ in train.data]
    sampler = DistributedBucketSampler(lengths, args.batch_size, world, rank, seed=0)
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate, num_workers=2, pin_memory=True)

    net = SmallTransformer(sp.get_piece_size()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(1, args.epochs + 1):
        model.train()
        tot = torch.zeros(2, device=device)
        for src, dec_in, dec_out, _ in loader:
            src, dec_in, dec_out = src.to(device), dec_in.to(device), dec_out.to(device)
            loss, nll, ntok = smoothed_ce(model(src, dec_in), dec_out)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([nll.detach(), ntok.float()])
        dist.all_reduce(tot)
        if rank == 0:
            net.eval()
            bleu = corpus_bleu(net, valid, sp, device)
            net.train()
            print(f"epoch {epoch:3d} | train ppl {math.exp((tot[0] / tot[1]).item()):.2f} | "
                  f"val BLEU {bleu:.2f} | lr {sched.get_last_lr()[0]:.2e}", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        paths = [os.path.join(args.out, f"epoch{e}.pt") for e in range(args.epochs - args.avg_last + 1, args.epochs + 1)]
        avg = None
        for p in paths:
            sd = torch.load(p, map_location="cpu")["model"]
            if avg is None:
                avg = {k: v.clone().float() for k, v in sd.items()}
            else:
                for k in avg:
                    avg[k] += sd[k].float()
        avg = {k: v / len(paths) for k, v in avg.items()}
        torch.save({"model": avg, "averaged": paths}, os.path.join(args.out, "averaged.pt"))
        net.load_state_dict(avg)
        net.eval()
        print(f"test2016 BLEU (avg of last {len(paths)}): {corpus_bleu(net, test, sp, device):.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
