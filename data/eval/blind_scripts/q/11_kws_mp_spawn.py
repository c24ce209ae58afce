# Keyword spotting on Google Speech Commands v2 (35 words), ResNet-ish CNN on log-mel.
# single node, spawns one process per GPU:
#   python 11_kws_mp_spawn.py --root /data/speech_commands_v0.02 --gpus 4
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SR = 16000


def parse_args():
    parser = argparse.ArgumentParser(description="KWS training")
    parser.add_argument("--root", required=True)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", type=str, default="23456")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="exp/kws_res15")
    return parser.parse_args()


def list_split(root):
    words = sorted(d for d in os.listdir(root)
                   if os.path.isdir(os.path.join(root, d)) and not d.startswith("_"))
    val = set(open(os.path.join(root, "validation_list.txt")).read().split())
    test = set(open(os.path.join(root, "testing_list.txt")).read().split())
    splits = {"train": [], "valid": [], "test": []}
    for label, w in enumerate(words):
        for f in sorted(os.listdir(os.path.join(root, w))):
            rel = f"{w}/{f}"
            key = "valid" if rel in val else "test" if rel in test else "train"
            splits[key].append((os.path.join(root, rel), label))
    return words, splits


class SpeechCommands(Dataset):
    def __init__(self, items, train=False):
        self.items = items
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=480, hop_length=160, n_mels=40)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        wav, sr = torchaudio.load(path)
        wav = wav[0]
        if wav.numel() < SR:
            wav = F.pad(wav, (0, SR - wav.numel()))
        wav = wav[:SR]
        if self.train:
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shift)
            wav = wav + 0.005 * random.random() * torch.randn_like(wav)
        feat = (self.mel(wav) + 1e-6).log()
        return feat.unsqueeze(0), label


class ResBlock(nn.Module):
    def __init__(self, ch, dil):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=dil, dilation=dil, bias=False)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=dil, dilation=dil, bias=False)
        self.b2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class Res15(nn.Module):
    def __init__(self, n_classes, ch=45):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(ch, 2 ** (i // 3)) for i in range(6)])
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def run_eval(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            s[0] += F.cross_entropy(out, y, reduction="sum")
            s[1] += (out.argmax(1) == y).sum()
            s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main_worker(gpu, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.gpus, rank=gpu)
    device = torch.device("cuda", gpu)
    torch.manual_seed(0)
    random.seed(gpu)

    words, splits = list_split(args.root)
    train_ds = SpeechCommands(splits["train"], train=True)
    valid_ds = SpeechCommands(splits["valid"])
    train_sampler = DistributedSampler(train_ds, num_replicas=args.gpus, rank=gpu, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, range(gpu, len(valid_ds), args.gpus)),
                              batch_size=256, num_workers=args.workers)

    model = Res15(len(words))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    writer = None
    if gpu == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"{len(words)} classes, train {len(train_ds)} valid {len(valid_ds)}")

    best_acc, it = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if writer and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), it)

        vloss, vacc = run_eval(model.module, valid_loader, device)
        if gpu == 0:
            print(f"epoch {epoch:2d} valid loss {vloss:.4f} acc {100 * vacc:.2f}% ({time.time() - t0:.0f}s)")
            writer.add_scalar("valid/acc", vacc, epoch)
            if vacc > best_acc:
                best_acc = vacc
                torch.save({"model": model.module.state_dict(), "words": words, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args))
