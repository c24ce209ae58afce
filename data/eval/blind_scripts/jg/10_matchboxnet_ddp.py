# MatchboxNet 3x1x64 for speech commands, distributed training.
#
# Usage:
#   torchrun --nproc_per_node=4 10_matchboxnet_ddp.py --data_dir /data/google_speech_commands_v2 \
#       --output_dir outputs/matchbox_3x1x64 --epochs 200
import argparse
import glob
import logging
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s - %(message)s")
logger = logging.getLogger("matchbox")

COMMANDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "zero", "one", "two",
            "three", "four", "five", "six", "seven", "eight", "nine", "bed", "bird", "cat", "dog", "happy",
            "house", "marvin", "sheila", "tree", "wow", "backward", "forward", "follow", "learn", "visual"]


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--output_dir", type=str, default="outputs/matchbox")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weight_decay", type=float, default=1e-3)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--save_every", type=int, default=10)
    return parser


class GSCDataset(Dataset):
    def __init__(self, data_dir, subset, augment=False):
        def read(fname):
            with open(os.path.join(data_dir, fname)) as f:
                return set(f.read().splitlines())

        val, test = read("validation_list.txt"), read("testing_list.txt")
        self.samples = []
        for cmd in COMMANDS:
            for path in sorted(glob.glob(os.path.join(data_dir, cmd, "*.wav"))):
                rel = f"{cmd}/{os.path.basename(path)}"
                which = "validation" if rel in val else ("testing" if rel in test else "training")
                if which == subset:
                    self.samples.append((path, COMMANDS.index(cmd)))
        self.augment = augment
        self.noise_files = sorted(glob.glob(os.path.join(data_dir, "_background_noise_", "*.wav")))
        self._noise_cache = {}

    def __len__(self):
        return len(self.samples)

    def noise(self):
        path = random.choice(self.noise_files)
        if path not in self._noise_cache:
            self._noise_cache[path] = torchaudio.load(path)[0][0]
        n = self._noise_cache[path]
        off = random.randint(0, n.numel() - 16000)
        return n[off:off + 16000]

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        wav = torchaudio.load(path)[0][0]
        wav = F.pad(wav, (0, max(0, 16000 - wav.numel())))[:16000]
        if self.augment:
            shift = random.randint(-5, 5) * 160
            wav = torch.roll(wav, shift)
            if random.random() < 0.8:
                gain_db = random.uniform(-90, -46)
                n = self.noise()
                wav = wav + n * (10 ** (gain_db / 20)) / (n.abs().max() + 1e-8)
        return wav, label


class MFCCFrontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.mfcc = torchaudio.transforms.MFCC(16000, n_mfcc=64, melkwargs={"n_fft": 512, "win_length": 400,
                                                                             "hop_length": 160, "n_mels": 64})
        self.spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(15),
                                      torchaudio.transforms.TimeMasking(25))

    def forward(self, wav, train=False):
        x = self.mfcc(wav)
        return self.spec_aug(x) if train else x


class SubBlock(nn.Module):
    def __init__(self, cin, cout, k, dilation=1):
        super().__init__()
        self.dw = nn.Conv1d(cin, cin, k, padding=dilation * (k // 2), dilation=dilation, groups=cin, bias=False)
        self.pw = nn.Conv1d(cin, cout, 1, bias=False)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):
        return self.bn(self.pw(self.dw(x)))


class MatchboxBlock(nn.Module):
    def __init__(self, cin, cout, k, repeat):
        super().__init__()
        subs, c = [], cin
        for _ in range(repeat):
            subs.append(SubBlock(c, cout, k))
            c = cout
        self.subs = nn.ModuleList(subs)
        self.res = nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        out = x
        for i, sub in enumerate(self.subs):
            out = sub(out)
            if i == len(self.subs) - 1:
                out = out + self.res(x)
            out = self.drop(F.relu(out))
        return out


class MatchboxNet(nn.Module):
    def __init__(self, n_classes, n_feats=64, b=3, r=1, c=64):
        super().__init__()
        self.prologue = nn.Sequential(SubBlock(n_feats, 128, 11), nn.ReLU())
        kernels = [13, 15, 17]
        blocks, cin = [], 128
        for i in range(b):
            blocks.append(MatchboxBlock(cin, c, kernels[i], r))
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.epilogue = nn.Sequential(SubBlock(c, 128, 29, dilation=2), nn.ReLU(),
                                      nn.Conv1d(128, 128, 1), nn.BatchNorm1d(128), nn.ReLU())
        self.decoder = nn.Linear(128, n_classes)

    def forward(self, x):
        x = self.epilogue(self.blocks(self.prologue(x)))
        return self.decoder(x.mean(-1))


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    train_ds = GSCDataset(args.data_dir, "training", augment=True)
    val_ds = GSCDataset(args.data_dir, "validation")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=args.num_workers)
    logger.info("world_size=%d train=%d val=%d", world_size, len(train_ds), len(val_ds))

    frontend = MFCCFrontend().to(device)
    model = MatchboxNet(len(COMMANDS)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.05, anneal_strategy="cos")
    os.makedirs(args.output_dir, exist_ok=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (wav, target) in enumerate(train_loader):
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.no_grad():
                feats = frontend(wav, train=True)
            loss = F.cross_entropy(model(feats), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for wav, target in val_loader:
                wav, target = wav.to(device), target.to(device)
                stats[0] += (model(frontend(wav)).argmax(1) == target).sum()
                stats[1] += target.size(0)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        acc = (stats[0] / stats[1]).item()
        logger.info("epoch %d val acc %.4f", epoch, acc)

        if rank == 0:
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
            if (epoch + 1) % args.save_every == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           os.path.join(args.output_dir, f"ckpt_{epoch + 1}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
