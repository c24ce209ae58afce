"""Prompted TTS decoder (AR over codec codebook 0) with frame-budget dynamic batching.

Utterance lengths vary from 1 s to 20 s, so we batch by total frames rather than by
count, and accumulate gradients over a few micro-batches.

    torchrun --standalone --nproc_per_node=8 07_prompt_tts_ar_dynamic_batches.py \
        --manifest /data/tts/codes/train.jsonl --valid /data/tts/codes/dev.jsonl --out exp/tts_ar
"""
import argparse
import contextlib
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler

VOCAB_TEXT = 256  # byte-level text
CARD = 1024
BOS, EOS, PAD = CARD, CARD + 1, CARD + 2


class CodesDataset(Dataset):
    def __init__(self, manifest):
        with open(manifest) as f:
            self.items = [json.loads(l) for l in f]
        self.lengths = [it["frames"] + len(it["text"].encode()) for it in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        text = torch.tensor(list(it["text"].encode("utf-8")), dtype=torch.long)
        codes = torch.from_numpy(np.load(it["codes"])[0].astype(np.int64))
        return text, codes


def collate(batch):
    texts, codes = zip(*batch)
    codes = [torch.cat([torch.tensor([BOS]), c, torch.tensor([EOS])]) for c in codes]
    return (pad_sequence(texts, True, 0), torch.tensor([len(t) for t in texts]),
            pad_sequence(codes, True, PAD), torch.tensor([len(c) for c in codes]))


class DistributedFrameBucketSampler(Sampler):
    """Deterministic (seed + epoch) frame-budget batches, split evenly across ranks."""

    def __init__(self, lengths, max_frames, num_replicas, rank, seed=0, shuffle=True):
        self.lengths, self.max_frames = lengths, max_frames
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        batches = []
        for start in range(0, n, 20_000):  # sort inside large pools for bucketing
            pool = sorted(order[start : start + 20_000], key=lambda i: self.lengths[i])
            cur, cur_max = [], 0
            for i in pool:
                new_max = max(cur_max, self.lengths[i])
                if cur and new_max * (len(cur) + 1) > self.max_frames:
                    batches.append(cur)
                    cur, new_max = [], self.lengths[i]
                cur.append(i)
                cur_max = new_max
            if cur:
                batches.append(cur)
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in perm]
        usable = len(batches) - len(batches) % self.num_replicas  # same step count on every rank
        return batches[:usable][self.rank :: self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class TTSDecoder(nn.Module):
    def __init__(self, dim=1024, heads=16, layers=16, max_len=4096):
        super().__init__()
        self.text_emb = nn.Embedding(VOCAB_TEXT, dim)
        self.code_emb = nn.Embedding(CARD + 3, dim)
        self.seg_emb = nn.Embedding(2, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, "gelu", batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CARD + 2)

    def forward(self, text, tlen, codes, clen):
        tt, tc = text.shape[1], codes.shape[1]
        x = torch.cat([self.text_emb(text) + self.seg_emb.weight[0], self.code_emb(codes) + self.seg_emb.weight[1]], 1)
        x = x + self.pos(torch.arange(tt + tc, device=x.device))
        causal = torch.triu(torch.ones(tt + tc, tt + tc, dtype=torch.bool, device=x.device), 1)
        causal[:tt, :tt] = False
        ar = torch.arange(max(tt, tc), device=x.device)
        pad = torch.cat([ar[None, :tt] >= tlen[:, None], ar[None, :tc] >= clen[:, None]], 1)
        h = self.ln(self.body(x, mask=causal, src_key_padding_mask=pad))
        return self.head(h[:, tt:])

    @torch.no_grad()
    def generate(self, text, tlen, max_frames=1500):
        codes = torch.full((text.shape[0], 1), BOS, device=text.device)
        for _ in range(max_frames):
            clen = torch.full((text.shape[0],), codes.shape[1], device=text.device)
            logits = self(text, tlen, codes, clen)[:, -1]
            nxt = torch.multinomial(F.softmax(logits / 0.9, -1), 1)
            codes = torch.cat([codes, nxt], 1)
            if (codes == EOS).any(1).all():
                break
        return codes[:, 1:]


def loss_fn(model, text, tlen, codes, clen):
    logits = model(text, tlen, codes[:, :-1], clen - 1)
    return F.cross_entropy(logits.transpose(1, 2).float(), codes[:, 1:], ignore_index=PAD)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-frames", type=int, default=12_000, help="frames per micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_ds, valid_ds = CodesDataset(args.manifest), CodesDataset(args.valid)
    sampler = DistributedFrameBucketSampler(train_ds.lengths, args.max_frames, world, rank, seed=args.seed)
    loader = DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate, num_workers=8, pin_memory=True)
    vsampler = DistributedFrameBucketSampler(valid_ds.lengths, args.max_frames, world, rank, shuffle=False)
    vloader = DataLoader(valid_ds, batch_sampler=vsampler, collate_fn=collate, num_workers=2)

    model = DDP(TTSDecoder().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) *
                                             min(1.0, math.sqrt(args.warmup / (s + 1))))
    os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(loader):
            text, tlen, codes, clen = (t.to(device, non_blocking=True) for t in batch)
            boundary = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_fn(model, text, tlen, codes, clen)
                (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        opt.zero_grad(set_to_none=True)  # drop a partial accumulation at the end of the epoch

        # ---- validation: teacher-forced loss + a few sampled lengths per rank
        net = model.module
        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for text, tlen, codes, clen in vloader:
                text, tlen, codes, clen = text.to(device), tlen.to(device), codes.to(device), clen.to(device)
                acc[0] += loss_fn(net, text, tlen, codes, clen) * text.shape[0]
                acc[1] += text.shape[0]
            probe = [valid_ds[j] for j in range(rank, min(len(valid_ds), 8 * world), world)]
            text, tlen, codes, clen = (t.to(device) for t in collate(probe))
            gen = net.generate(text, tlen)
            gen_len = (gen != EOS).cumprod(1).sum(1).tolist()
            ref_len = (clen - 2).tolist()
        dist.all_reduce(acc)
        ratios = [g / max(r, 1) for g, r in zip(gen_len, ref_len)]
        all_ratios = [None] * world
        dist.all_gather_object(all_ratios, ratios)
        if rank == 0:
            flat = [r for part in all_ratios for r in part]
            print(f"[valid] epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} "
                  f"len_ratio {np.mean(flat):.3f}+-{np.std(flat):.3f} (n={len(flat)})", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
