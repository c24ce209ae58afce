"""CRNN keyword spotter (conv front + unidirectional GRU) for always-on streaming.

Training uses whole 1 s clips; validation runs the model the way the device
does: 100 ms feature chunks, GRU state carried between chunks, posteriors
smoothed over a 300 ms window and the clip decision taken at the peak.

    torchrun --nproc_per_node=4 05_crnn_streaming_eval.py --data /data/gsc_v2 --out exp/crnn_stream
"""
import argparse
import glob
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

WORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
CLASSES = ["_filler_"] + WORDS
HOP = 160
CHUNK_FRAMES = 10  # 100 ms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="exp/crnn_stream")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--smooth-frames", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class GSC(Dataset):
    def __init__(self, root, split, train=False, pad_s=0.5):
        lists = {n: set(open(os.path.join(root, f"{n}_list.txt")).read().split())
                 for n in ("validation", "testing")}
        self.items = []
        for path in sorted(glob.glob(os.path.join(root, "*", "*.wav"))):
            word = os.path.basename(os.path.dirname(path))
            if word.startswith("_"):
                continue
            rel = f"{word}/{os.path.basename(path)}"
            s = "validation" if rel in lists["validation"] else "testing" if rel in lists["testing"] else "training"
            if s == split:
                self.items.append((path, CLASSES.index(word) if word in WORDS else 0))
        self.noise = [torchaudio.load(p)[0][0] for p in sorted(glob.glob(os.path.join(root, "_background_noise_", "*.wav")))]
        self.train = train
        self.len = int(16000 * (1 + pad_s))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav = torchaudio.load(path)[0][0][:16000]
        lead = random.randint(0, self.len - wav.numel()) if self.train else (self.len - wav.numel()) // 2
        wav = F.pad(wav, (lead, self.len - wav.numel() - lead))
        if self.train and random.random() < 0.8:
            n = random.choice(self.noise)
            o = random.randint(0, n.numel() - self.len)
            wav = wav + random.uniform(0.0, 0.15) * n[o:o + self.len]
        return wav, y


class Fbank(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=HOP, n_mels=40, center=False)

    def forward(self, wav):
        return (self.mel(wav) + 1e-6).log().transpose(1, 2)  # B, T, 40


class CRNN(nn.Module):
    def __init__(self, n_classes, hidden=128, n_mels=40):
        super().__init__()
        # causal in time: kernel (3, 5) padded only on the left via F.pad below
        self.conv = nn.Conv2d(1, 32, (3, 5), stride=(1, 2), padding=(0, 2))
        self.bn = nn.BatchNorm2d(32)
        self.proj = nn.Linear(32 * (n_mels // 2), hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, n_classes)
        self.hidden = hidden

    def init_state(self, batch, device):
        return (torch.zeros(batch, 1, 2, 40, device=device),               # conv left context
                torch.zeros(2, batch, self.hidden, device=device))          # GRU state

    def forward(self, feats, state=None):
        b, t, f = feats.shape
        x = feats.unsqueeze(1)
        if state is None:
            ctx = x.new_zeros(b, 1, 2, f)
            h = None
        else:
            ctx, h = state
        x = torch.cat([ctx, x], dim=2)
        new_ctx = x[:, :, -2:]
        x = F.relu(self.bn(self.conv(x)))            # B, 32, T, F/2
        x = x.permute(0, 2, 1, 3).reshape(b, t, -1)
        x, h = self.gru(F.relu(self.proj(x)), h)
        return self.out(x), (new_ctx, h)


def clip_loss(frame_logits, y):
    # max-pooling loss: keyword clips supervise their best frame, filler all frames
    logp = frame_logits.log_softmax(-1)
    kw = y > 0
    loss = frame_logits.new_zeros(())
    if kw.any():
        loss = loss - logp[kw].gather(2, y[kw, None, None].expand(-1, logp.size(1), 1)).max(1).values.mean()
    if (~kw).any():
        loss = loss - logp[~kw][..., 0].mean()
    return loss


@torch.no_grad()
def streaming_eval(model, fbank, loader, device, smooth):
    model.eval()
    hits = torch.zeros(2, device=device)
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        feats = fbank(wav)
        state = model.init_state(wav.size(0), device)
        posts = []
        for s in range(0, feats.size(1), CHUNK_FRAMES):
            logits, state = model(feats[:, s:s + CHUNK_FRAMES], state)
            posts.append(logits.softmax(-1))
        posts = torch.cat(posts, 1)
        smoothed = F.avg_pool1d(posts.transpose(1, 2), smooth, stride=1, padding=smooth // 2,
                                count_include_pad=False).transpose(1, 2)
        kw_peak, kw_idx = smoothed[..., 1:].max(-1).values.max(-1)
        pred = torch.where(kw_peak > 0.5, smoothed[..., 1:].max(1).values.argmax(-1) + 1, torch.zeros_like(y))
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = GSC(args.data, "training", train=True), GSC(args.data, "validation")
    tsamp = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    tl = DataLoader(train_ds, args.bs, sampler=tsamp, num_workers=args.workers, pin_memory=True, drop_last=True)
    vl = DataLoader(val_ds, 128, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers)

    fbank = Fbank().to(device)
    model = CRNN(len(CLASSES), args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tl))

    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        tsamp.set_epoch(epoch)
        model.train()
        tot, n = 0.0, 0
        for wav, y in tl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                feats = fbank(wav)
            logits, _ = model(feats)
            loss = clip_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot, n = tot + loss.item(), n + 1

        acc = streaming_eval(model, fbank, vl, device, args.smooth_frames)
        if rank == 0:
            print(f"epoch {epoch:3d} train_loss {tot / max(n, 1):.4f} streaming_acc {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
