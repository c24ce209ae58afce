"""res15 (Tang & Lin, 2018) keyword spotting, multi-GPU.

Trains on Speech Commands (12 labels), keeps the checkpoint with the best
validation accuracy and reports test accuracy of that checkpoint at the end.

    torchrun --nproc_per_node=4 07_res15_best_ckpt_test.py --data-dir /data/speech_commands --work-dir work/res15
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGETS = "yes no up down left right on off stop go".split()


class SpeechCommandsMFCC(Dataset):
    def __init__(self, data_dir, split, train):
        with open(os.path.join(data_dir, f"{split}.json")) as f:
            self.items = json.load(f)  # [{"path": ..., "label": ...}, ...], made by prepare_gsc.py
        self.labels = ["__silence__", "__unknown__"] + TARGETS
        self.train = train
        bg_dir = os.path.join(data_dir, "_background_noise_")
        self.bg = [torchaudio.load(os.path.join(bg_dir, f))[0][0] for f in sorted(os.listdir(bg_dir))
                   if f.endswith(".wav")]
        self.mfcc = torchaudio.transforms.MFCC(
            16000, n_mfcc=40, melkwargs=dict(n_fft=480, hop_length=160, n_mels=40, f_min=20, f_max=4000))

    def __len__(self):
        return len(self.items)

    def _background(self):
        bg = random.choice(self.bg)
        s = random.randint(0, bg.numel() - 16000)
        return bg[s:s + 16000]

    def __getitem__(self, i):
        item = self.items[i]
        label = self.labels.index(item["label"])
        if item["path"] is None:
            wav = torch.zeros(16000)
        else:
            wav = torchaudio.load(item["path"])[0][0][:16000]
            wav = F.pad(wav, (0, 16000 - wav.numel()))
        if self.train:
            t = random.randint(-1600, 1600)
            wav = F.pad(wav, (max(t, 0), max(-t, 0)))[max(-t, 0):max(-t, 0) + 16000]
            if random.random() < 0.8 or label == 0:
                wav = wav + self._background() * random.uniform(0, 0.1)
        return self.mfcc(wav), label


class Res15(nn.Module):
    def __init__(self, n_labels, n_maps=45, n_layers=13):
        super().__init__()
        self.conv0 = nn.Conv2d(1, n_maps, 3, padding=1, bias=False)
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        for i in range(n_layers):
            d = int(2 ** (i // 3))
            self.convs.append(nn.Conv2d(n_maps, n_maps, 3, padding=d, dilation=d, bias=False))
            self.bns.append(nn.BatchNorm2d(n_maps, affine=False))
        self.output = nn.Linear(n_maps, n_labels)

    def forward(self, x):
        x = x.unsqueeze(1)
        y = old_x = F.relu(self.conv0(x))
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            y = F.relu(conv(y))
            if i % 2 == 1:
                y = y + old_x
                old_x = y
            y = bn(y)
        return self.output(y.mean(dim=(2, 3)))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        torch.manual_seed(args.seed)
        random.seed(args.seed + self.rank)
        np.random.seed(args.seed + self.rank)

        self.train_set = SpeechCommandsMFCC(args.data_dir, "train", True)
        self.val_set = SpeechCommandsMFCC(args.data_dir, "valid", False)
        self.test_set = SpeechCommandsMFCC(args.data_dir, "test", False)
        self.train_sampler = DistributedSampler(self.train_set, shuffle=True, seed=args.seed)
        self.train_loader = DataLoader(self.train_set, args.batch_size, sampler=self.train_sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)

        net = Res15(len(self.train_set.labels)).to(self.device)
        self.model = DistributedDataParallel(net, device_ids=[self.local_rank])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5,
                                   nesterov=True)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, milestones=args.milestones, gamma=0.1)
        self.best_path = os.path.join(args.work_dir, "best.pt")
        if self.is_main:
            os.makedirs(args.work_dir, exist_ok=True)

    def loader(self, ds):
        return DataLoader(ds, 256, sampler=DistributedSampler(ds, shuffle=False),
                          num_workers=self.args.workers, pin_memory=True)

    @torch.no_grad()
    def accuracy(self, ds):
        self.model.eval()
        c = torch.zeros(2, device=self.device)
        for x, y in self.loader(ds):
            x, y = x.to(self.device), y.to(self.device)
            c[0] += (self.model(x).argmax(-1) == y).sum()
            c[1] += y.numel()
        dist.all_reduce(c)
        return (c[0] / c[1]).item()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        meter = torch.zeros(2, device=self.device)
        for x, y in self.train_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        self.sched.step()
        dist.all_reduce(meter)
        return (meter[0] / meter[1]).item()

    def fit(self):
        best = -1.0
        for epoch in range(self.args.epochs):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            acc = self.accuracy(self.val_set)
            if self.is_main:
                print(f"epoch {epoch:02d} loss {loss:.4f} val {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if acc > best:
                    torch.save({"epoch": epoch, "state_dict": self.model.module.state_dict(), "val_acc": acc},
                               self.best_path)
            best = max(best, acc)

        ckpt = torch.load(self.best_path, map_location=self.device)
        self.model.module.load_state_dict(ckpt["state_dict"])
        test_acc = self.accuracy(self.test_set)
        if self.is_main:
            print(f"best epoch {ckpt['epoch']} val {ckpt['val_acc']:.4f} test {test_acc:.4f}")
            with open(os.path.join(self.args.work_dir, "results.json"), "w") as f:
                json.dump({"best_epoch": ckpt["epoch"], "val_acc": ckpt["val_acc"], "test_acc": test_acc}, f)
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--work-dir", default="work/res15")
    p.add_argument("--epochs", type=int, default=26)
    p.add_argument("--milestones", type=int, nargs="+", default=[9, 18])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=7)
    Trainer(p.parse_args()).fit()


if __name__ == "__main__":
    main()
