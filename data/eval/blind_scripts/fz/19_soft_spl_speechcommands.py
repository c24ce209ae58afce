"""Keyword spotting on Speech Commands v2 (35 words) with soft self-paced
weighting: inside every batch a sample gets weight v = max(0, 1 - loss / lambda)
(linear soft SPL regulariser), and lambda grows each epoch so that more and more
of the hard / noisy clips take part.

    torchrun --nproc_per_node=4 19_soft_spl_speechcommands.py --root /data/speech --save-dir ckpt/kws_spl
"""
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = ["backward", "bed", "bird", "cat", "dog", "down", "eight", "five", "follow", "forward", "four", "go",
          "happy", "house", "learn", "left", "marvin", "nine", "no", "off", "on", "one", "right", "seven",
          "sheila", "six", "stop", "three", "tree", "two", "up", "visual", "wow", "yes", "zero"]
LABEL_TO_ID = {w: i for i, w in enumerate(LABELS)}


class KWSDataset(Dataset):
    def __init__(self, root, subset):
        self.ds = torchaudio.datasets.SPEECHCOMMANDS(root, subset=subset, download=False)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        wav, sr, label, *_ = self.ds[i]
        wav = wav[0, :16000]
        wav = F.pad(wav, (0, 16000 - wav.numel()))
        return wav, LABEL_TO_ID[label]


class LogMel(nn.Module):
    def __init__(self, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=n_mels)
        self.spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(8), torchaudio.transforms.TimeMasking(20))

    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log()
        if self.training:
            x = self.spec_aug(x)
        return x.unsqueeze(1)


class ResBlock(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class Res15(nn.Module):
    def __init__(self, n_classes=35, c=45):
        super().__init__()
        self.frontend = LogMel()
        self.conv0 = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.blocks = nn.Sequential(*[ResBlock(c, 2 ** (i // 3)) for i in range(6)])
        self.bn = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, wav):
        x = F.relu(self.conv0(self.frontend(wav)))
        x = self.bn(self.blocks(x))
        return self.fc(x.mean((2, 3)))


def save_checkpoint(state, is_best, save_dir, filename="checkpoint.pth.tar"):
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(save_dir, "model_best.pth.tar"))


def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    with torch.no_grad():
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t[0] += (model(wav).argmax(1) == y).sum()
            t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lam0", type=float, default=2.0)
    ap.add_argument("--lam-growth", type=float, default=1.1)
    ap.add_argument("--save-dir", default="ckpt/kws_spl")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.root, exist_ok=True)
        torchaudio.datasets.SPEECHCOMMANDS(args.root, download=True)
    dist.barrier()
    train_set, val_set = KWSDataset(args.root, "training"), KWSDataset(args.root, "validation")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=256, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Res15()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world ** 0.5, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world ** 0.5,
                                                    total_steps=args.epochs * len(train_loader), pct_start=0.1)

    lam, best_acc = args.lam0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(3, device=device)
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            per = F.cross_entropy(model(wav), y, reduction="none")
            v = (1.0 - per.detach() / lam).clamp(min=0.0)
            loss = (v * per).sum() / v.sum().clamp(min=1.0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            agg += torch.stack([per.detach().sum(), (v > 0).float().sum(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(agg)
        lam *= args.lam_growth

        acc = evaluate(model.module, val_loader, device)
        is_best = acc > best_acc
        best_acc = max(acc, best_acc)
        if rank == 0:
            print(f"epoch {epoch} loss {agg[0] / agg[2]:.4f} active {agg[1] / agg[2]:.3f} lambda {lam:.2f} "
                  f"val_acc {acc:.4f} best {best_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
        save_checkpoint({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "lam": lam, "best_acc": best_acc},
                        is_best, args.save_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
