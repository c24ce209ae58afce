"""Sweep of learning rate and SpecAugment strength for a keyword-spotting CNN
(Speech Commands v2, 35 words).  Trials are run sequentially on all GPUs.

    torchrun --standalone --nproc_per_node=4 12_kws_specaug_sweep.py --root /data/speech_commands
"""
import argparse
import json
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

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left marvin "
                "nine no off on one right seven sheila six stop three tree two up visual wow yes zero".split())
LABEL2ID = {w: i for i, w in enumerate(LABELS)}

TRIALS = [
    {"lr": 1e-3, "freq_mask": 0, "time_mask": 0},
    {"lr": 1e-3, "freq_mask": 15, "time_mask": 35},
    {"lr": 3e-3, "freq_mask": 15, "time_mask": 35},
    {"lr": 3e-3, "freq_mask": 27, "time_mask": 70},
    {"lr": 6e-3, "freq_mask": 15, "time_mask": 35},
    {"lr": 6e-3, "freq_mask": 27, "time_mask": 70},
]


class SpeechCommands(Dataset):
    def __init__(self, root, subset):
        self.ds = torchaudio.datasets.SPEECHCOMMANDS(root, download=False, subset=subset)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        wav, sr, label, *_ = self.ds[i]
        wav = wav[0]
        if wav.numel() < sr:
            wav = F.pad(wav, (0, sr - wav.numel()))
        return wav[:sr], LABEL2ID[label]


class LogMel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=64)

    def forward(self, wav):
        return torch.log(self.mel(wav) + 1e-6).unsqueeze(1)


class KWSNet(nn.Module):
    def __init__(self, n_classes=len(LABELS), width=64):
        super().__init__()

        def block(cin, cout, pool):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                      nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(2))
            return nn.Sequential(*layers)

        self.features = nn.Sequential(block(1, width, True), block(width, 2 * width, True),
                                      block(2 * width, 4 * width, True), block(4 * width, 4 * width, False))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(4 * width, n_classes)

    def forward(self, x):
        x = self.features(x)
        return self.fc(self.drop(x.mean(dim=(2, 3))))


def spec_augment(spec, freq_mask, time_mask):
    if freq_mask:
        spec = torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True)(spec)
    if time_mask:
        spec = torchaudio.transforms.TimeMasking(time_mask, iid_masks=True)(spec)
    return spec


@torch.no_grad()
def evaluate(model, featurizer, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for wav, y in loader:
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (model(featurizer(wav)).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def run(trial, args, loaders, device, local_rank):
    train_loader, val_loader = loaders
    featurizer = LogMel().to(device)
    model = DDP(KWSNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=trial["lr"], weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, trial["lr"], total_steps=args.epochs * len(train_loader))
    best, since_best = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # random time shift of up to 100 ms
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shifts=shift, dims=1)
            spec = spec_augment(featurizer(wav), trial["freq_mask"], trial["time_mask"])
            loss = F.cross_entropy(model(spec), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = evaluate(model, featurizer, val_loader, device)
        if acc > best:
            best, since_best = acc, 0
        else:
            since_best += 1
        if since_best >= args.patience:
            break
    del model, opt
    torch.cuda.empty_cache()
    return best, epoch + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/speech_commands")
    ap.add_argument("--out", default="sweeps/kws")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_set = SpeechCommands(args.root, "training")
    val_set = SpeechCommands(args.root, "validation")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), 256, num_workers=4, pin_memory=True)

    results = []
    for i, trial in enumerate(TRIALS):
        t0 = time.time()
        best, epochs = run(trial, args, (train_loader, val_loader), device, local_rank)
        results.append({**trial, "val_acc": best, "epochs": epochs, "secs": round(time.time() - t0)})
        if rank == 0:
            print(f"trial {i}: {trial} -> {best:.4f} after {epochs} epochs", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
