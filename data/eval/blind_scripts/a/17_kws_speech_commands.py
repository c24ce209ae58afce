"""Keyword spotting on Google Speech Commands v2 (35 words) with a small res-net on MFCCs.

    python -m torch.distributed.launch --nproc_per_node=4 train_kws.py --root data/SpeechCommands
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
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

parser = argparse.ArgumentParser(description="KWS training")
parser.add_argument("--root", default="data")
parser.add_argument("--epochs", type=int, default=40)
parser.add_argument("--batch_size", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--n_mfcc", type=int, default=40)
parser.add_argument("--num_workers", type=int, default=8)
parser.add_argument("--save", default="kws_res15.pt")
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()


class SubsetSC(SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False)

        def load_list(name):
            with open(os.path.join(self._path, name)) as f:
                return {os.path.normpath(os.path.join(self._path, line.strip())) for line in f}

        if subset == "validation":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("validation_list.txt")]
        elif subset == "testing":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("testing_list.txt")]
        else:
            excludes = load_list("validation_list.txt") | load_list("testing_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) not in excludes]


class Featurizer:
    def __init__(self, labels, n_mfcc, train):
        self.index = {l: i for i, l in enumerate(labels)}
        self.train = train
        self.mfcc = torchaudio.transforms.MFCC(16000, n_mfcc=n_mfcc,
                                               melkwargs={"n_fft": 480, "hop_length": 160, "n_mels": 40})

    def __call__(self, batch):
        feats, targets = [], []
        for wav, sr, label, *_ in batch:
            wav = F.pad(wav[0], (0, 16000 - wav.size(1)))[:16000]
            if self.train:
                shift = random.randint(-1600, 1600)
                wav = torch.roll(wav, shift)
                wav = wav + 0.005 * torch.randn_like(wav) * random.random()
            feats.append(self.mfcc(wav))
            targets.append(self.index[label])
        return torch.stack(feats).unsqueeze(1), torch.tensor(targets)


class Res15(nn.Module):
    def __init__(self, n_classes, ch=45, layers=13):
        super().__init__()
        self.conv0 = nn.Conv2d(1, ch, 3, padding=1, bias=False)
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        for i in range(layers):
            d = 2 ** (i // 3)
            self.convs.append(nn.Conv2d(ch, ch, 3, padding=d, dilation=d, bias=False))
            self.bns.append(nn.BatchNorm2d(ch, affine=False))
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, x):
        x = F.relu(self.conv0(x))
        res = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = F.relu(conv(x))
            if i % 2 == 1:
                x = x + res
                res = x
            x = bn(x)
        return self.fc(x.mean(dim=(2, 3)))


def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            s[0] += (model.module(x).argmax(-1) == y).sum()
            s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(rank)

    train_set = SubsetSC(args.root, "training")
    valid_set = SubsetSC(args.root, "validation")
    test_set = SubsetSC(args.root, "testing")
    labels = sorted({os.path.basename(os.path.dirname(w)) for w in train_set._walker})
    valid_set = Subset(valid_set, range(rank, len(valid_set), world))
    test_set = Subset(test_set, range(rank, len(test_set), world))

    sampler = DistributedSampler(train_set, shuffle=True)
    per_gpu = args.batch_size // world
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=args.num_workers,
                              collate_fn=Featurizer(labels, args.n_mfcc, train=True), pin_memory=True,
                              drop_last=True)
    eval_collate = Featurizer(labels, args.n_mfcc, train=False)
    valid_loader = DataLoader(valid_set, batch_size=256, num_workers=args.num_workers, collate_fn=eval_collate)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.num_workers, collate_fn=eval_collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Res15(len(labels))).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        val_acc = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(run[0] / run[1]).item():.4f} val acc {val_acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "labels": labels}, args.save)
        dist.barrier()

    ckpt = torch.load(args.save, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_acc = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"test acc of best model: {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
