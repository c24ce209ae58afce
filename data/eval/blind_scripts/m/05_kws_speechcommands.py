"""
Keyword spotting on Google Speech Commands v2 (35 words), log-mel + small ResNet-ish CNN.

    torchrun --standalone --nproc_per_node=4 05_kws_speechcommands.py --root /data/speech_commands_v0.02

batch size is per process.
"""
import argparse
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


def read_list(root, name):
    with open(os.path.join(root, name)) as f:
        return set(l.strip() for l in f if l.strip())


def build_splits(root):
    labels = sorted(d for d in os.listdir(root)
                    if os.path.isdir(os.path.join(root, d)) and not d.startswith("_"))
    val_set = read_list(root, "validation_list.txt")
    test_set = read_list(root, "testing_list.txt")
    train, val, test = [], [], []
    for li, lab in enumerate(labels):
        for fn in sorted(os.listdir(os.path.join(root, lab))):
            rel = f"{lab}/{fn}"
            item = (os.path.join(root, rel), li)
            if rel in val_set:
                val.append(item)
            elif rel in test_set:
                test.append(item)
            else:
                train.append(item)
    return labels, train, val, test


class SpeechCommands(Dataset):
    def __init__(self, items, train=False, noise_dir=None):
        self.items = items
        self.train = train
        self.noises = []
        if train and noise_dir and os.path.isdir(noise_dir):
            for fn in os.listdir(noise_dir):
                if fn.endswith(".wav"):
                    wav, _ = sf.read(os.path.join(noise_dir, fn), dtype="float32")
                    self.noises.append(wav)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        wav, sr = sf.read(path, dtype="float32")
        assert sr == SR
        if len(wav) < SR:
            wav = np.pad(wav, (0, SR - len(wav)))
        wav = wav[:SR]
        if self.train:
            shift = random.randint(-1600, 1600)
            wav = np.roll(wav, shift)
            if self.noises and random.random() < 0.8:
                nz = random.choice(self.noises)
                st = random.randint(0, len(nz) - SR)
                wav = wav + random.uniform(0.0, 0.1) * nz[st:st + SR]
        return torch.from_numpy(wav.astype(np.float32)), label


class Frontend(nn.Module):
    def __init__(self, n_mels=40):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=480, hop_length=160, n_mels=n_mels)

    def forward(self, wav):
        return torch.log(self.mel(wav) + 1e-6).unsqueeze(1)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class KWSNet(nn.Module):
    def __init__(self, n_classes, c=64):
        super().__init__()
        self.front = Frontend()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(6)])
        self.fc = nn.Linear(c, n_classes)

    def forward(self, wav):
        x = self.stem(self.front(wav))
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for wav, y in loader:
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(wav)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="runs/kws")
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    local_rank, rank, world = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    labels, train_items, val_items, test_items = build_splits(args.root)
    if rank == 0:
        print(f"{len(labels)} classes | train {len(train_items)} val {len(val_items)} test {len(test_items)}")
        os.makedirs(args.out, exist_ok=True)

    train_ds = SpeechCommands(train_items, train=True, noise_dir=os.path.join(args.root, "_background_noise_"))
    val_ds = SpeechCommands(val_items)
    test_ds = SpeechCommands(test_items)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    def eval_loader(ds):
        part = torch.utils.data.Subset(ds, list(range(rank, len(ds), world)))
        return DataLoader(part, batch_size=512, shuffle=False, num_workers=args.workers)

    val_dl, test_dl = eval_loader(val_ds), eval_loader(test_ds)

    # lr scaled linearly with the number of processes (global batch = world * batch_size)
    lr = args.lr * world
    model = DDP(KWSNet(len(labels)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)

    best_acc = 0.0
    ckpt_path = os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for wav, y in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(wav), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run[0] += loss.detach()
            run[1] += 1
        dist.all_reduce(run)
        val_loss, val_acc = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"ep {epoch:02d} train {run[0].item() / run[1].item():.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": model.module.state_dict(), "labels": labels, "epoch": epoch}, ckpt_path)
        dist.barrier()

    ck = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(ck["model"])
    test_loss, test_acc = evaluate(model.module, test_dl, device)
    if rank == 0:
        print(f"best epoch {ck['epoch']}  test acc {test_acc * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
