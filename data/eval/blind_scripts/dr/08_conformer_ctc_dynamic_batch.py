"""Conformer-CTC with BPE units and dynamic (frame-budget) batching.

Features are precomputed 80-dim fbank stored as .npy (one per utterance), listed in a TSV:
    utt_id \t feats.npy \t num_frames \t text

    torchrun --nproc_per_node=8 08_conformer_ctc_dynamic_batch.py \
        --train data/fbank/train.tsv --dev data/fbank/dev.tsv --bpe data/bpe500.model --exp exp/conf_ctc_bpe500
"""
import argparse
import math
import os
import random
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter
import editdistance


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--bpe", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--max_frames", type=int, default=40000, help="frame budget per batch (per GPU)")
    ap.add_argument("--max_utt_frames", type=int, default=3000)
    ap.add_argument("--d_model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def read_tsv(path, max_frames=None):
    rows = []
    with open(path) as f:
        for line in f:
            uid, npy, nf, text = line.rstrip("\n").split("\t", 3)
            if max_frames and int(nf) > max_frames:
                continue
            rows.append((uid, npy, int(nf), text))
    return rows


class FbankSet(Dataset):
    def __init__(self, rows, sp, train):
        self.rows, self.sp, self.train = rows, sp, train
        self.freq_mask = torchaudio.transforms.FrequencyMasking(30)
        self.time_mask = torchaudio.transforms.TimeMasking(40, p=0.1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, npy, _, text = self.rows[i]
        x = torch.from_numpy(np.load(npy)).float()  # (T, 80)
        if self.train:
            x = x.t()
            for _ in range(2):
                x = self.freq_mask(x)
            for _ in range(5):
                x = self.time_mask(x)
            x = x.t()
        y = torch.tensor(self.sp.encode(text.lower()), dtype=torch.long) + 1  # 0 is blank
        return x, y, text


def collate(batch):
    xs, ys, texts = zip(*batch)
    xl = torch.tensor([x.size(0) for x in xs])
    yl = torch.tensor([y.size(0) for y in ys])
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), xl,
            nn.utils.rnn.pad_sequence(ys, batch_first=True), yl, list(texts))


class DistributedDynamicBatchSampler(Sampler):
    def __init__(self, num_frames, max_frames, rank, world_size, seed=0, num_buckets=50):
        self.num_frames = num_frames
        self.max_frames = max_frames
        self.rank, self.world_size = rank, world_size
        self.seed, self.epoch = seed, 0
        self.num_buckets = num_buckets

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _make_batches(self):
        rng = random.Random(self.seed + self.epoch)
        indices = list(range(len(self.num_frames)))
        rng.shuffle(indices)
        shard = indices[self.rank::self.world_size]
        shard.sort(key=lambda i: self.num_frames[i])
        per_bucket = math.ceil(len(shard) / self.num_buckets)
        batches = []
        for b in range(0, len(shard), per_bucket):
            cur, cur_max = [], 0
            for i in shard[b:b + per_bucket]:
                longest = max(cur_max, self.num_frames[i])
                if cur and longest * (len(cur) + 1) > self.max_frames:
                    batches.append(cur)
                    cur, longest = [], self.num_frames[i]
                cur.append(i)
                cur_max = longest
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._make_batches())

    def __len__(self):
        return len(self._make_batches())


class Subsample4(nn.Module):
    def __init__(self, idim, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.SiLU(), nn.Conv2d(d, d, 3, 2), nn.SiLU())
        self.proj = nn.Linear(d * (((idim - 1) // 2 - 1) // 2), d)

    def forward(self, x, xl):
        x = self.conv(x.unsqueeze(1))
        x = self.proj(x.permute(0, 2, 1, 3).flatten(2))
        return x, ((xl - 1) // 2 - 1) // 2


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d_model, layers, heads):
        super().__init__()
        self.front = Subsample4(80, d_model)
        self.enc = torchaudio.models.Conformer(input_dim=d_model, num_heads=heads, ffn_dim=4 * d_model,
                                               num_layers=layers, depthwise_conv_kernel_size=31, dropout=0.1,
                                               use_group_norm=True)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x, xl):
        x, xl = self.front(x, xl)
        x, xl = self.enc(x, xl)
        return self.out(x), xl


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.bpe)
    vocab = sp.get_piece_size() + 1
    train_rows = read_tsv(args.train, args.max_utt_frames)
    dev_rows = sorted(read_tsv(args.dev), key=lambda r: r[2])[rank::world]

    train_sampler = DistributedDynamicBatchSampler([r[2] for r in train_rows], args.max_frames, rank, world,
                                                   seed=args.seed)
    train_dl = DataLoader(FbankSet(train_rows, sp, True), batch_sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, persistent_workers=True)
    dev_dl = DataLoader(FbankSet(dev_rows, sp, False), batch_size=32, collate_fn=collate, num_workers=2)

    model = ConformerCTC(vocab, args.d_model, args.layers, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    ctc_loss = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    tb = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, xl, y, yl, _ in train_dl:
            x, xl, y, yl = (t.to(device, non_blocking=True) for t in (x, xl, y, yl))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ol = model(x, xl)
            lp = logits.float().log_softmax(-1).transpose(0, 1)
            loss = ctc_loss(lp, y, ol, yl) / x.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("train/ctc", loss.item(), step)
                tb.add_scalar("train/grad_norm", gn.item(), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"epoch {epoch} step {step} ctc {loss.item():.3f} {time.time() - tic:.0f}s", flush=True)

        model.eval()
        err = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, xl, _, _, texts in dev_dl:
                logits, ol = model.module(x.to(device), xl.to(device))
                best = logits.argmax(-1)
                for k, text in enumerate(texts):
                    ids = torch.unique_consecutive(best[k, : ol[k]])
                    hyp = sp.decode([int(i) - 1 for i in ids if i != 0])
                    ref = text.lower().split()
                    err[0] += editdistance.eval(ref, hyp.split())
                    err[1] += len(ref)
        dist.all_reduce(err)
        if rank == 0:
            wer = (err[0] / err[1]).item()
            tb.add_scalar("dev/wer", wer, step)
            print(f"== epoch {epoch}: dev WER {100 * wer:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.exp, f"epoch_{epoch}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
