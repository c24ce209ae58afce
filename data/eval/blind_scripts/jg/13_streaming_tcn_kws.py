"""Streaming causal-TCN keyword spotter with a DET sweep on long-form audio.

Training: 1.5 s clips, gradient accumulation over `--accum` micro-batches.
Evaluation: each rank streams its share of the long-form dev recordings
through the model in 40 ms hops (state carried between hops), produces a
list of (peak score, is_keyword) detections, and rank 0 sweeps thresholds on
the union to pick the operating point at 1 FA/h.

    torchrun --nproc_per_node=4 13_streaming_tcn_kws.py --train-list lists/train.tsv \
        --longform-dir /data/kws_longform_dev --out exp/tcn_stream
"""
import argparse
import csv
import glob
import json
import os
import random
from contextlib import nullcontext

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR, HOP = 16000, 160
STEP_FRAMES = 4  # 40 ms per streaming step


class ClipSet(Dataset):
    def __init__(self, tsv, noise_glob, clip_s=1.5):
        with open(tsv) as f:
            self.rows = [(r[0], int(r[1])) for r in csv.reader(f, delimiter="\t")]
        self.noise = sorted(glob.glob(noise_glob))
        self.n = int(clip_s * SR)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, y = self.rows[i]
        wav, _ = sf.read(path, dtype="float32")
        wav = torch.from_numpy(wav[: self.n])
        lead = random.randint(0, self.n - wav.numel())
        wav = F.pad(wav, (lead, self.n - wav.numel() - lead))
        if self.noise and random.random() < 0.75:
            nz, _ = sf.read(random.choice(self.noise), dtype="float32", frames=self.n, fill_value=0.0)
            wav = wav + torch.from_numpy(nz) * random.uniform(0.01, 0.3)
        return wav, y


class CausalBlock(nn.Module):
    def __init__(self, ch, k, d):
        super().__init__()
        self.ctx = (k - 1) * d
        self.dw = nn.Conv1d(ch, ch, k, dilation=d, groups=ch)
        self.pw = nn.Conv1d(ch, ch, 1)
        self.norm = nn.GroupNorm(1, ch)

    def forward(self, x, cache):
        # cache holds the last `ctx` input frames of the previous step
        xin = torch.cat([cache, x], dim=-1)
        y = self.pw(F.gelu(self.dw(xin)))
        return x + self.norm(y), xin[..., -self.ctx:]


class StreamingTCN(nn.Module):
    def __init__(self, n_classes, n_mels=40, ch=96, k=3, dilations=(1, 2, 4, 8, 1, 2, 4, 8)):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=400, hop_length=HOP, n_mels=n_mels, center=False)
        self.inp = nn.Conv1d(n_mels, ch, 1)
        self.blocks = nn.ModuleList(CausalBlock(ch, k, d) for d in dilations)
        self.out = nn.Conv1d(ch, n_classes, 1)
        self.ch = ch

    def features(self, wav):
        return (self.mel(wav) + 1e-6).log()

    def init_state(self, batch, device):
        return [torch.zeros(batch, self.ch, b.ctx, device=device) for b in self.blocks]

    def forward(self, feats, state=None):
        x = self.inp(feats)
        if state is None:
            state = self.init_state(x.size(0), x.device)
        new_state = []
        for blk, c in zip(self.blocks, state):
            x, c = blk(x, c)
            new_state.append(c)
        return self.out(x), new_state  # (B, C, T) frame logits


def train_loss(frame_logits, y):
    # keyword clips: supervise the max frame; filler (0): every frame is filler
    logp = frame_logits.log_softmax(1)
    kw = y > 0
    loss = -logp[~kw, 0].mean() if (~kw).any() else frame_logits.sum() * 0.0
    if kw.any():
        loss = loss - logp[kw].gather(1, y[kw][:, None, None].expand(-1, 1, logp.size(2))).amax(2).mean()
    return loss


@torch.no_grad()
def stream_file(net, path, device, label_path):
    wav, _ = sf.read(path, dtype="float32")
    wav = torch.from_numpy(wav).to(device)[None]
    feats = net.features(wav)
    state = net.init_state(1, device)
    post = []
    for s in range(0, feats.size(-1), STEP_FRAMES):
        logits, state = net(feats[..., s:s + STEP_FRAMES], state)
        post.append(logits.softmax(1)[0, 1:].amax(0))
    post = torch.cat(post).cpu()
    with open(label_path) as f:
        events = json.load(f)  # [[start_s, end_s], ...] keyword occurrences
    dets = []
    peaks = (post[1:-1] > post[:-2]) & (post[1:-1] >= post[2:]) & (post[1:-1] > 0.05)
    for f_idx in (peaks.nonzero().flatten() + 1).tolist():
        t = f_idx * HOP / SR
        dets.append((float(post[f_idx]), any(a - 0.25 <= t <= b + 0.5 for a, b in events)))
    return dets, wav.size(-1) / SR


def det_sweep(dets, hours, n_events, target_fa_h=1.0):
    dets.sort(key=lambda d: -d[0])
    tp = fa = 0
    op = None
    for score, hit in dets:
        tp, fa = tp + hit, fa + (not hit)
        if fa / hours <= target_fa_h:
            op = (score, tp / max(n_events, 1), fa / hours)
    return op


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--noise-glob", default="/data/noise/**/*.wav")
    ap.add_argument("--longform-dir", required=True)
    ap.add_argument("--n-classes", type=int, default=4)
    ap.add_argument("--out", default="exp/tcn_stream")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--micro-bs", type=int, default=64)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)
    random.seed(3 + rank)

    train = ClipSet(args.train_list, args.noise_glob)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.micro_bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    longform = sorted(glob.glob(os.path.join(args.longform_dir, "*.wav")))
    my_files = longform[rank::world]

    model = DDP(StreamingTCN(args.n_classes).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    updates_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * updates_per_epoch)

    start = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        for i, (wav, y) in enumerate(loader):
            if i >= updates_per_epoch * args.accum:
                break
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            with torch.no_grad():
                feats = model.module.features(wav)
            with nullcontext() if sync_now else model.no_sync():
                logits, _ = model(feats)
                loss = train_loss(logits, y) / args.accum
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        # streaming eval on the raw module: ranks have different numbers of files/steps
        net = model.module.eval()
        dets, secs, n_events = [], 0.0, 0
        for path in my_files:
            label_path = path[:-4] + ".json"
            d, s = stream_file(net, path, device, label_path)
            dets += d
            secs += s
            n_events += len(json.load(open(label_path)))
        gathered = [None] * world
        dist.all_gather_object(gathered, (dets, secs, n_events))
        if rank == 0:
            all_dets = [d for g in gathered for d in g[0]]
            hours = sum(g[1] for g in gathered) / 3600.0
            events = sum(g[2] for g in gathered)
            op = det_sweep(all_dets, hours, events)
            print(f"epoch {epoch}: {hours:.1f} h, {events} keywords, op@1FA/h = {op}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "op": op}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
