"""Far-field KWS training with RIR convolution + background noise.

Reverberation with 0.5-1 s RIRs is expensive on CPU, so the RIR and noise
banks are kept on the GPU and the augmentation runs there (FFT convolution).
Model: ConvMixer-style KWS (~120k params).

    torchrun --nproc_per_node=8 16_gpu_noise_rir_aug.py --clips /data/farfield_kws/train.lst \
        --rirs /data/rirs_noises/simulated_rirs --noises /data/musan/noise --out exp/convmixer_far
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

SR = 16000


def load_bank(folder, max_items, max_len, device):
    files = sorted(glob.glob(os.path.join(folder, "**", "*.wav"), recursive=True))[:max_items]
    bank = torch.zeros(len(files), max_len)
    for i, f in enumerate(files):
        w, sr = torchaudio.load(f)
        if sr != SR:
            w = torchaudio.functional.resample(w, sr, SR)
        w = w[0, :max_len]
        bank[i, : w.numel()] = w
    return bank.to(device)


class FarFieldAugment:
    def __init__(self, rirs, noises, p_rir=0.7, p_noise=0.8, snr=(0.0, 20.0)):
        self.rirs = rirs / rirs.norm(dim=1, keepdim=True).clamp_min(1e-8)
        self.noises = noises
        self.p_rir, self.p_noise, self.snr = p_rir, p_noise, snr

    def __call__(self, wav):
        wav = wav.to(self.rirs.device)
        n = wav.numel()
        if random.random() < self.p_rir:
            rir = self.rirs[random.randrange(len(self.rirs))]
            direct = rir.abs().argmax()
            wav = torchaudio.functional.fftconvolve(wav, rir)[direct:direct + n]
        if random.random() < self.p_noise:
            noise = self.noises[random.randrange(len(self.noises))]
            off = random.randint(0, noise.numel() - n)
            noise = noise[off:off + n]
            snr = random.uniform(*self.snr)
            gain = wav.norm() / (noise.norm() + 1e-8) * 10 ** (-snr / 20)
            wav = wav + gain * noise
        return wav.cpu()


class FarFieldClips(Dataset):
    def __init__(self, list_file, classes, augment=None):
        with open(list_file) as f:
            self.items = [line.split() for line in f if line.strip()]  # "<wav> <label>"
        self.cls = {c: i for i, c in enumerate(classes)}
        self.augment = augment

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        wav = torchaudio.load(path)[0][0, :SR]
        wav = F.pad(wav, (0, SR - wav.numel()))
        if self.augment is not None:
            wav = self.augment(wav)
        return wav, self.cls[label]


class ConvMixerBlock(nn.Module):
    def __init__(self, dim, k):
        super().__init__()
        self.dw = nn.Sequential(nn.Conv1d(dim, dim, k, padding=k // 2, groups=dim), nn.GELU(), nn.BatchNorm1d(dim))
        self.pw = nn.Sequential(nn.Conv1d(dim, dim, 1), nn.GELU(), nn.BatchNorm1d(dim))

    def forward(self, x):
        return self.pw(x + self.dw(x))


class ConvMixerKWS(nn.Module):
    def __init__(self, n_classes, n_mels=64, dim=96, depth=6, k=9):
        super().__init__()
        self.front = torchaudio.transforms.MelSpectrogram(SR, n_fft=512, win_length=400, hop_length=160,
                                                          n_mels=n_mels)
        self.patch = nn.Sequential(nn.Conv1d(n_mels, dim, 3, stride=2, padding=1), nn.GELU(), nn.BatchNorm1d(dim))
        self.blocks = nn.Sequential(*[ConvMixerBlock(dim, k) for _ in range(depth)])
        self.fc = nn.Linear(dim, n_classes)

    def forward(self, wav):
        x = (self.front(wav) + 1e-6).log()
        x = x - x.mean(-1, keepdim=True)
        return self.fc(self.blocks(self.patch(x)).mean(-1))


def run_epoch(model, loader, device, opt=None, sched=None):
    train = opt is not None
    model.train(train)
    stats = torch.zeros(3, device=device)
    with torch.set_grad_enabled(train):
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(wav)
            loss = F.cross_entropy(logits, y, label_smoothing=0.05 if train else 0.0)
            if train:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            stats += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clips", required=True)
    ap.add_argument("--dev-clips", default=None)
    ap.add_argument("--classes", default="hey_nova,stop,next,previous,volume_up,volume_down,filler")
    ap.add_argument("--rirs", required=True)
    ap.add_argument("--noises", required=True)
    ap.add_argument("--out", default="exp/convmixer_far")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    classes = args.classes.split(",")
    rirs = load_bank(args.rirs, max_items=2000, max_len=SR, device=device)
    noises = load_bank(args.noises, max_items=500, max_len=10 * SR, device=device)
    augment = FarFieldAugment(rirs, noises)
    train_set = FarFieldClips(args.clips, classes, augment=augment)
    dev_set = FarFieldClips(args.dev_clips or args.clips.replace("train", "dev"), classes)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    dev_loader = DataLoader(dev_set, 256, sampler=DistributedSampler(dev_set, shuffle=False), num_workers=4)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(ConvMixerKWS(len(classes))).to(device),
                device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.08)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tr_loss, tr_acc = run_epoch(model, train_loader, device, opt, sched)
        dev_loss, dev_acc = run_epoch(model, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} train {tr_loss:.3f}/{tr_acc:.3f} dev {dev_loss:.3f}/{dev_acc:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if dev_acc > best:
                best = dev_acc
                torch.save({"model": model.module.state_dict(), "classes": classes},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
