"""Hello-Edge style CNN/LSTM KWS trained on cached log-mel features.

Decoding + feature extraction of ~100k one-second clips dominates the epoch
time for these tiny models, so the log-mel features are computed once per
split and stored next to the data as a single tensor file.  Augmentation is
done in the feature domain (SpecAugment + mixing in cached noise features).

    torchrun --nproc_per_node=4 12_cached_logmel_kws.py --root /data/speech_commands_v0.02 --arch lstm
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

WANTED = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
N_MELS, N_FRAMES = 40, 101


def label_of(word):
    return WANTED.index(word) + 2 if word in WANTED else 1  # 0 silence, 1 unknown


def split_files(root):
    val = set(open(os.path.join(root, "validation_list.txt")).read().split())
    test = set(open(os.path.join(root, "testing_list.txt")).read().split())
    out = {"train": [], "val": [], "test": []}
    for word in sorted(os.listdir(root)):
        d = os.path.join(root, word)
        if not os.path.isdir(d) or word.startswith("_"):
            continue
        for f in sorted(os.listdir(d)):
            rel = f"{word}/{f}"
            out["val" if rel in val else "test" if rel in test else "train"].append((os.path.join(d, f), label_of(word)))
    return out


def compute_logmel(paths, show):
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=N_MELS)
    feats = torch.empty(len(paths), N_MELS, N_FRAMES)
    for i, p in enumerate(tqdm(paths, disable=not show, desc="log-mel")):
        wav = torchaudio.load(p)[0][0][:16000]
        wav = F.pad(wav, (0, 16000 - wav.numel()))
        feats[i] = (mel(wav) + 1e-6).log()
    return feats


def noise_logmel(root):
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=N_MELS)
    chunks = []
    ndir = os.path.join(root, "_background_noise_")
    for f in sorted(os.listdir(ndir)):
        if f.endswith(".wav"):
            wav = torchaudio.load(os.path.join(ndir, f))[0][0]
            for s in range(0, wav.numel() - 16000, 8000):
                chunks.append(mel(wav[s:s + 16000]))
    return torch.stack(chunks)  # linear mel power, mixed before the log


def load_or_build_cache(root, cache_dir, rank):
    path = os.path.join(cache_dir, "logmel_v2.pt")
    if not os.path.exists(path):
        files = split_files(root)
        cache = {"noise": noise_logmel(root)}
        for split, items in files.items():
            cache[split] = (compute_logmel([p for p, _ in items], rank == 0),
                            torch.tensor([y for _, y in items]))
        os.makedirs(cache_dir, exist_ok=True)
        torch.save(cache, path)
    return torch.load(path)


class CachedFeatures(Dataset):
    def __init__(self, feats, labels, noise=None, silence_frac=0.1, train=False):
        n_sil = int(len(labels) * silence_frac)
        self.feats, self.labels = feats, labels
        self.n_sil = n_sil if noise is not None else 0
        self.noise = noise
        self.train = train
        self.fmask = torchaudio.transforms.FrequencyMasking(6)
        self.tmask = torchaudio.transforms.TimeMasking(12)

    def __len__(self):
        return len(self.labels) + self.n_sil

    def __getitem__(self, i):
        if i >= len(self.labels):
            x = self.noise[random.randrange(len(self.noise))] * random.uniform(0.0, 1.0)
            return (x + 1e-6).log(), 0
        x = self.feats[i]
        if self.train and self.noise is not None and random.random() < 0.8:
            n = self.noise[random.randrange(len(self.noise))]
            x = (x.exp() + random.uniform(0.0, 0.05) * n + 1e-6).log()
        if self.train:
            x = self.tmask(self.fmask(x.unsqueeze(0))).squeeze(0)
        return x, int(self.labels[i])


class LSTMKWS(nn.Module):
    def __init__(self, n_classes, hidden=118, proj=98):
        super().__init__()
        self.lstm = nn.LSTM(N_MELS, hidden, batch_first=True, proj_size=proj)
        self.fc = nn.Linear(proj, n_classes)

    def forward(self, x):
        out, _ = self.lstm(x.transpose(1, 2))
        return self.fc(out[:, -1])


class CNNKWS(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 28, (10, 4), stride=(1, 1)), nn.BatchNorm2d(28), nn.ReLU(),
            nn.Conv2d(28, 30, (10, 4), stride=(2, 1)), nn.BatchNorm2d(30), nn.ReLU(),
            nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(), nn.Linear(480, 16), nn.ReLU(), nn.Linear(16, n_classes))

    def forward(self, x):
        return self.net(x.unsqueeze(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--arch", choices=["lstm", "cnn"], default="lstm")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--save", default="exp/hello_edge")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    cache = load_or_build_cache(args.root, args.cache_dir or os.path.join(args.root, ".cache"), rank)
    train_set = CachedFeatures(*cache["train"], noise=cache["noise"], train=True)
    val_set = CachedFeatures(*cache["val"])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_set, 500, sampler=DistributedSampler(val_set, shuffle=False), num_workers=2)

    n_classes = len(WANTED) + 2
    net = LSTMKWS(n_classes) if args.arch == "lstm" else CNNKWS(n_classes)
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.2)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen, loss_sum = time.time(), 0, 0.0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item() * y.numel()
            seen += y.numel()
        sched.step()

        model.eval()
        res = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                res += torch.stack([(model(x).argmax(1) == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(res)
        acc = (res[0] / res[1]).item()
        if rank == 0:
            print(f"[{epoch:02d}] loss(rank0) {loss_sum / seen:.4f}  val acc {acc:.4f}  {time.time() - t0:.1f}s", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.save, exist_ok=True)
                torch.save({"arch": args.arch, "model": model.module.state_dict(), "acc": acc},
                           os.path.join(args.save, f"{args.arch}_best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
