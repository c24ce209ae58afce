"""Audio-visual conformer CTC on pre-extracted LRS2 features.

Visual features (25 fps, 512-d) come from a frozen lip encoder, audio is 80-d
log-mel at 100 fps stacked 4x to 25 fps. Batches are bucketed by duration, so
ranks get different numbers of batches per epoch.

    python 03_lrs2_conformer_ctc_join.py --feats /data/lrs2_feats --gpus 8
"""
import argparse
import math
import os
import random
import time

import editdistance
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler

CHARS = " '0123456789abcdefghijklmnopqrstuvwxyz"
BLANK = 0
CHAR2ID = {c: i + 1 for i, c in enumerate(CHARS)}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--feats", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--exp", default="exp/lrs2_conformer")
    p.add_argument("--max-frames-per-batch", type=int, default=6000)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--peak-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--p-mask-modality", type=float, default=0.3)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class AVFeatDataset(Dataset):
    def __init__(self, root, split):
        self.root = root
        self.rows = []
        with open(os.path.join(root, split + ".lst")) as f:
            for line in f:
                uid, n, text = line.rstrip("\n").split(" ", 2)
                self.rows.append((uid, int(n), text.lower()))

    def __len__(self):
        return len(self.rows)

    def lengths(self):
        return [r[1] for r in self.rows]

    def __getitem__(self, i):
        uid, n, text = self.rows[i]
        d = torch.load(os.path.join(self.root, "feats", uid + ".pt"), map_location="cpu")
        v = d["video"].float()  # T x 512
        a = d["fbank"].float()  # 4T' x 80
        t = min(v.size(0), a.size(0) // 4)
        a = a[: 4 * t].reshape(t, 320)
        y = torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID], dtype=torch.long)
        return v[:t], a, y


def collate(batch):
    v, a, y = zip(*batch)
    return (pad_sequence(v, batch_first=True), pad_sequence(a, batch_first=True),
            torch.tensor([x.size(0) for x in v]), torch.cat(y), torch.tensor([x.size(0) for x in y]))


class BucketBatchSampler(Sampler):
    """Duration-bucketed batches; every rank builds the same list, then takes its share."""

    def __init__(self, lengths, max_frames, rank, world, seed=0):
        self.lengths = lengths
        self.max_frames = max_frames
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        batches, cur, longest = [], [], 0
        for i in order:
            longest = max(longest, self.lengths[i])
            if cur and longest * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest = [], self.lengths[i]
            cur.append(i)
        if cur:
            batches.append(cur)
        g.shuffle(batches)
        return batches[self.rank::self.world]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class ConformerBlock(nn.Module):
    def __init__(self, d, heads=4, kernel=31, drop=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(drop), nn.Linear(4 * d, d))
        self.ln_att = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.ln_conv = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.ln_dw = nn.LayerNorm(d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(drop), nn.Linear(4 * d, d))
        self.ln_out = nn.LayerNorm(d)
        self.drop = nn.Dropout(drop)

    def forward(self, x, pad):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.drop(self.att(h, h, h, key_padding_mask=pad, need_weights=False)[0])
        h = self.ln_conv(x).masked_fill(pad.unsqueeze(-1), 0.0).transpose(1, 2)
        h = F.glu(self.pw1(h), dim=1)
        h = self.dw(h).transpose(1, 2)
        h = self.pw2(F.silu(self.ln_dw(h)).transpose(1, 2)).transpose(1, 2)
        x = x + self.drop(h)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class AVConformerCTC(nn.Module):
    def __init__(self, d=256, layers=12, vocab=len(CHARS) + 1):
        super().__init__()
        self.v_in = nn.Sequential(nn.Linear(512, d), nn.LayerNorm(d))
        self.a_in = nn.Sequential(nn.Linear(320, d), nn.LayerNorm(d))
        self.fuse = nn.Linear(2 * d, d)
        self.blocks = nn.ModuleList([ConformerBlock(d) for _ in range(layers)])
        self.out = nn.Linear(d, vocab)

    def forward(self, v, a, lens, keep_v=None, keep_a=None):
        pad = torch.arange(v.size(1), device=v.device)[None] >= lens[:, None]
        hv, ha = self.v_in(v), self.a_in(a)
        if keep_v is not None:
            # per-utterance modality masking: both branches always run
            hv = hv * keep_v[:, None, None]
            ha = ha * keep_a[:, None, None]
        x = self.fuse(torch.cat([hv, ha], -1))
        for blk in self.blocks:
            x = blk(x, pad)
        return self.out(x).log_softmax(-1)


def greedy_decode(logp, lens):
    out = []
    for i, seq in enumerate(logp.argmax(-1).cpu()):
        seq = torch.unique_consecutive(seq[: lens[i]]).tolist()
        out.append("".join(CHARS[s - 1] for s in seq if s != BLANK))
    return out


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    errs = words = 0
    for v, a, lens, y, ylens in loader:
        logp = net(v.to(device), a.to(device), lens.to(device))
        hyps = greedy_decode(logp, lens)
        refs, off = [], 0
        for n in ylens.tolist():
            refs.append("".join(CHARS[c - 1] for c in y[off:off + n].tolist()))
            off += n
        for h, r in zip(hyps, refs):
            errs += editdistance.eval(h.split(), r.split())
            words += len(r.split())
    net.train()
    return errs / max(1, words)


def worker(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    train = AVFeatDataset(args.feats, "train")
    dev = AVFeatDataset(args.feats, "val")
    sampler = BucketBatchSampler(train.lengths(), args.max_frames_per_batch, rank, world, seed=1234)
    loader = DataLoader(train, batch_sampler=sampler, num_workers=6, collate_fn=collate, pin_memory=True)
    dev_loader = DataLoader(dev, batch_size=32, shuffle=False, num_workers=4, collate_fn=collate)

    net = AVConformerCTC().to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))

    ckpt_path = os.path.join(args.exp, "last.pt")
    start = 0
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        t0 = time.time()
        with Join([model]):
            for v, a, lens, y, ylens in loader:
                v, a, lens = v.to(device, non_blocking=True), a.to(device, non_blocking=True), lens.to(device)
                keep_v = (torch.rand(v.size(0), device=device) > args.p_mask_modality).float()
                keep_a = torch.where(keep_v == 0, torch.ones_like(keep_v),
                                     (torch.rand(v.size(0), device=device) > args.p_mask_modality).float())
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logp = model(v, a, lens, keep_v, keep_a)
                loss = F.ctc_loss(logp.float().transpose(0, 1), y.to(device), lens, ylens.to(device),
                                  blank=BLANK, reduction="sum", zero_infinity=True) / v.size(0)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                sched.step()
                tot[0] += loss.detach() * v.size(0)
                tot[1] += v.size(0)

        dist.all_reduce(tot)
        if rank == 0:
            wer = validate(net, dev_loader, device)
            print(f"epoch {epoch}: train ctc {tot[0].item() / tot[1].item():.3f} "
                  f"dev WER {100 * wer:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
