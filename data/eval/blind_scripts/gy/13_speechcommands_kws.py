#!/usr/bin/env python3
"""
Keyword spotting on Google Speech Commands v0.02 (35 words), small CNN on
log-mel spectrograms. Trained across my desktop and the old mining rig.

desktop : RTX 3060    192.168.0.50  (rank 0)
rig     : RTX 2060 6G 192.168.0.57

  torchrun --nnodes=2 --nproc_per_node=1 --node_rank=$R --master_addr=192.168.0.50 \
      --master_port=29505 kws_train.py --data ~/data/speech_commands
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchaudio.datasets import SPEECHCOMMANDS

SAMPLE_RATE = 16000


class SubsetSC(SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False)

        def load_list(name):
            path = os.path.join(self._path, name)
            with open(path) as f:
                return {os.path.normpath(os.path.join(self._path, line.strip())) for line in f}

        if subset == "validation":
            keep = load_list("validation_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) in keep]
        elif subset == "testing":
            keep = load_list("testing_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) in keep]
        elif subset == "training":
            excludes = load_list("validation_list.txt") | load_list("testing_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) not in excludes]


LABELS = sorted(["backward", "bed", "bird", "cat", "dog", "down", "eight", "five", "follow",
                 "forward", "four", "go", "happy", "house", "learn", "left", "marvin", "nine",
                 "no", "off", "on", "one", "right", "seven", "sheila", "six", "stop", "three",
                 "tree", "two", "up", "visual", "wow", "yes", "zero"])
LABEL_TO_IDX = {w: i for i, w in enumerate(LABELS)}


def pad_1s(wav):
    if wav.size(-1) < SAMPLE_RATE:
        wav = F.pad(wav, (0, SAMPLE_RATE - wav.size(-1)))
    return wav[..., :SAMPLE_RATE]


def collate(batch):
    wavs, targets = [], []
    for waveform, _, label, *_ in batch:
        wavs.append(pad_1s(waveform))
        targets.append(LABEL_TO_IDX[label])
    return torch.stack(wavs), torch.tensor(targets)


class KWSNet(nn.Module):
    def __init__(self, n_classes=35, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160,
                                                        n_mels=n_mels)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(1, 32), block(32, 64), block(64, 128), block(128, 256))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3),
                                  nn.Linear(256, n_classes))

    def forward(self, wav):
        x = self.db(self.mel(wav))
        x = (x - x.mean(dim=(-2, -1), keepdim=True)) / (x.std(dim=(-2, -1), keepdim=True) + 1e-5)
        return self.head(self.features(x))


def time_shift(wav, max_shift=1600):
    shift = int(torch.randint(-max_shift, max_shift + 1, (1,)))
    return torch.roll(wav, shifts=shift, dims=-1)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/speech_commands"))
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--ckpt", default="kws_cnn.pt")
    return ap.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = total = 0
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        correct += (net(wav).argmax(1) == y).sum().item()
        total += y.numel()
    return correct / max(total, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = SubsetSC(args.data, "training")
    val_set = SubsetSC(args.data, "validation")
    train_loader = DataLoader(train_set, batch_size=args.bs, shuffle=True, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, collate_fn=collate,
                            num_workers=4)

    model = KWSNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))

    if rank == 0:
        print(f"{len(train_set)} train clips, {len(val_set)} val clips, world {world}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for wav, y in train_loader:
            wav = time_shift(wav).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            wav = wav + 0.005 * torch.randn_like(wav)
            logits = model(wav)
            loss = F.cross_entropy(logits, y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        if rank == 0:
            acc = evaluate(model.module, val_loader, device)
            print(f"epoch {epoch + 1:02d} loss {(run[0] / run[1]).item():.4f} val acc {acc:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "labels": LABELS, "acc": acc},
                           args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
