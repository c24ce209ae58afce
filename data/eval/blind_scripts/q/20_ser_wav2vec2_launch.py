# Speech emotion recognition: wav2vec2-base + mean pooling + MLP head.
# 4 classes (neu/hap/ang/sad), leave-one-session-out on IEMOCAP-style csv (path,label,session).
#
# python -m torch.distributed.launch --nproc_per_node=4 20_ser_wav2vec2_launch.py \
#     --csv data/iemocap.csv --test-session 5 --output_dir exp/ser_fold5
import argparse
import csv
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import Wav2Vec2Model

LABELS = ["neu", "hap", "ang", "sad"]


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--test-session", type=int, default=5)
    parser.add_argument("--pretrained", default="facebook/wav2vec2-base")
    parser.add_argument("--output_dir", default="exp/ser")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--head_lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--max_sec", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


class EmotionDataset(Dataset):
    def __init__(self, rows, max_samples, train):
        self.rows = rows
        self.max_samples = max_samples
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label = self.rows[i]
        wav, sr = sf.read(path, dtype="float32")
        if wav.ndim > 1:
            wav = wav.mean(1)
        if len(wav) > self.max_samples:
            start = random.randint(0, len(wav) - self.max_samples) if self.train else 0
            wav = wav[start:start + self.max_samples]
        wav = (wav - wav.mean()) / (wav.std() + 1e-7)
        return torch.from_numpy(wav), LABELS.index(label)


def collate(batch):
    wavs, labels = zip(*batch)
    lens = torch.tensor([w.numel() for w in wavs])
    return nn.utils.rnn.pad_sequence(wavs, batch_first=True), lens, torch.tensor(labels)


class SERModel(nn.Module):
    def __init__(self, pretrained, n_classes):
        super().__init__()
        self.wav2vec2 = Wav2Vec2Model.from_pretrained(pretrained, layerdrop=0.0, mask_time_prob=0.05)
        self.wav2vec2.freeze_feature_encoder()
        hid = self.wav2vec2.config.hidden_size
        self.head = nn.Sequential(nn.Linear(hid, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, n_classes))

    def forward(self, wav, lens):
        h = self.wav2vec2(wav).last_hidden_state
        flens = self.wav2vec2._get_feat_extract_output_lengths(lens).clamp(max=h.size(1))
        mask = (torch.arange(h.size(1), device=h.device)[None] < flens[:, None]).unsqueeze(-1).float()
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(len(LABELS), len(LABELS), device=device)
    for wav, lens, y in loader:
        pred = model(wav.to(device), lens.to(device)).argmax(-1)
        for t, p in zip(y.tolist(), pred.tolist()):
            conf[t, p] += 1
    dist.all_reduce(conf)
    model.train()
    wa = (conf.diag().sum() / conf.sum()).item()
    ua = (conf.diag() / conf.sum(1).clamp(min=1)).mean().item()
    return wa, ua


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    with open(args.csv) as f:
        rows = [r for r in csv.DictReader(f) if r["label"] in LABELS]
    train_rows = [(r["path"], r["label"]) for r in rows if int(r["session"]) != args.test_session]
    test_rows = [(r["path"], r["label"]) for r in rows if int(r["session"]) == args.test_session]
    max_samples = int(args.max_sec * 16000)
    train_ds = EmotionDataset(train_rows, max_samples, train=True)
    test_ds = EmotionDataset(test_rows, max_samples, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                             batch_size=8, collate_fn=collate, num_workers=2)

    # rank 0 downloads the pretrained weights first
    if rank != 0:
        dist.barrier()
    model = SERModel(args.pretrained, len(LABELS))
    if rank == 0:
        dist.barrier()
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    enc_params = [p for n, p in model.module.named_parameters() if n.startswith("wav2vec2") and p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[args.lr, args.head_lr], total_steps=total,
                                                    pct_start=0.1, anneal_strategy="linear")

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(args.output_dir)
        print(f"train {len(train_ds)} test {len(test_ds)} | {len(train_loader)} steps/epoch on {world} GPUs")

    best_ua, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for wav, lens, y in train_loader:
            wav, lens, y = wav.to(device), lens.to(device), y.to(device)
            loss = F.cross_entropy(model(wav, lens), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        wa, ua = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: WA {100 * wa:.2f} UA {100 * ua:.2f}", flush=True)
            writer.add_scalar("test/WA", wa, epoch)
            writer.add_scalar("test/UA", ua, epoch)
            if ua > best_ua:
                best_ua = ua
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"fold {args.test_session}: best UA {100 * best_ua:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
