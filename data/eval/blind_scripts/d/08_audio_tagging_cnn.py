"""
Multi-label audio tagging (AudioSet balanced / FSD50K) with a CNN14-style model on log-mel spectrograms.

    torchrun --nproc_per_node=4 08_audio_tagging_cnn.py --train-csv fsd50k/dev.csv --eval-csv fsd50k/eval.csv \
        --audio-dir fsd50k/clips_16k --num-classes 200
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter

SR = 16000
CLIP_SECONDS = 10


class TaggingDataset(Dataset):
    """CSV columns: fname, labels (comma separated class indices)."""

    def __init__(self, csv_path, audio_dir, num_classes, train):
        self.df = pd.read_csv(csv_path)
        self.audio_dir = audio_dir
        self.num_classes = num_classes
        self.train = train
        self.n = SR * CLIP_SECONDS

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        wav, sr = sf.read(os.path.join(self.audio_dir, f"{row['fname']}.wav"), dtype="float32")
        assert sr == SR
        if wav.ndim > 1:
            wav = wav.mean(1)
        if len(wav) >= self.n:
            start = random.randint(0, len(wav) - self.n) if self.train else 0
            wav = wav[start:start + self.n]
        else:
            wav = np.pad(wav, (0, self.n - len(wav)))
        if self.train:
            wav = wav * random.uniform(0.5, 1.5)
        target = torch.zeros(self.num_classes)
        for c in str(row["labels"]).split(","):
            target[int(c)] = 1.0
        return torch.from_numpy(wav), target


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, 2)


class CNN14(nn.Module):
    def __init__(self, num_classes, n_mels=64):
        super().__init__()
        self.melspec = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=320, n_mels=n_mels,
                                                            f_min=50, f_max=8000)
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.bn0 = nn.BatchNorm2d(n_mels)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.Sequential(*[ConvBlock(chans[i], chans[i + 1]) for i in range(6)])
        self.fc1 = nn.Linear(2048, 2048)
        self.head = nn.Linear(2048, num_classes)
        self.specaug = nn.Sequential(torchaudio.transforms.TimeMasking(64),
                                     torchaudio.transforms.FrequencyMasking(8))

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            x = self.to_db(self.melspec(wav.float()))       # B, M, T
        x = self.bn0(x.unsqueeze(-1)).squeeze(-1)           # norm over mel bins
        if self.training:
            x = self.specaug(x)
        x = self.blocks(x.unsqueeze(1))                      # B, C, M', T'
        x = x.mean(dim=2)
        x = x.max(dim=2).values + x.mean(dim=2)
        x = F.dropout(F.relu(self.fc1(F.dropout(x, 0.5, self.training))), 0.5, self.training)
        return self.head(x)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    scores, targets = [], []
    for wav, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(wav.to(device, non_blocking=True))
        scores.append(torch.sigmoid(logits.float()).cpu().numpy())
        targets.append(y.numpy())
    local = (np.concatenate(scores), np.concatenate(targets))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    s = np.concatenate([p[0] for p in parts])
    t = np.concatenate([p[1] for p in parts])
    keep = t.sum(0) > 0
    model.train()
    return float(average_precision_score(t[:, keep], s[:, keep], average="macro"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--eval-csv", required=True)
    ap.add_argument("--audio-dir", required=True)
    ap.add_argument("--num-classes", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--logdir", default="runs/cnn14")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    train_set = TaggingDataset(args.train_csv, args.audio_dir, args.num_classes, train=True)
    eval_set = TaggingDataset(args.eval_csv, args.audio_dir, args.num_classes, train=False)
    eval_part = Subset(eval_set, list(range(rank, len(eval_set), world)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    eval_loader = DataLoader(eval_part, batch_size=64, shuffle=False, num_workers=args.workers)

    model = CNN14(args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, pct_start=0.05,
                                                    total_steps=args.epochs * len(train_loader))
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best_map = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(loss_acc)
        mAP = evaluate(model.module, eval_loader, device)
        if rank == 0:
            tr_loss = (loss_acc[0] / loss_acc[1]).item()
            print(f"epoch {epoch}: train bce {tr_loss:.4f} eval mAP {mAP:.4f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("train/bce", tr_loss, epoch)
            writer.add_scalar("eval/mAP", mAP, epoch)
            if mAP > best_map:
                best_map = mAP
                os.makedirs(args.logdir, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.logdir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
