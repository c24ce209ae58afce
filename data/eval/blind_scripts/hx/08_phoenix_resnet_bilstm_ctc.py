"""Continuous sign language recognition on RWTH-PHOENIX-Weather 2014.

Frame encoder (ResNet-18) -> 1D temporal conv (K5-P2-K5-P2) -> BiLSTM -> CTC over glosses.

    torchrun --nproc_per_node=4 08_phoenix_resnet_bilstm_ctc.py \
        --data-root /data/phoenix2014-release/phoenix-2014-multisigner --out runs/phoenix_r18
"""
import argparse
import json
import logging
import os
import random

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("phoenix")

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def read_corpus(path):
    # PHOENIX corpus csv: id|folder|signer|annotation
    rows = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            vid, folder, signer, annotation = line.rstrip("\n").split("|")
            rows.append({"id": vid, "folder": folder, "signer": signer, "glosses": annotation.split()})
    return rows


class PhoenixVideos(Dataset):
    def __init__(self, root, split, gloss2id, train, max_frames=300, size=224):
        self.root = root
        self.split = split
        self.items = read_corpus(os.path.join(root, "annotations", "manual", f"{split}.corpus.csv"))
        self.gloss2id = gloss2id
        self.train = train
        self.max_frames = max_frames
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        frame_dir = os.path.join(self.root, "features", "fullFrame-256x256px", self.split,
                                 item["folder"].replace("/*.png", ""))
        names = sorted(os.listdir(frame_dir))
        if self.train:
            # temporal rescaling augmentation (+-20%), as in VAC / SMKD
            scale = random.uniform(0.8, 1.2)
            n = min(self.max_frames, max(int(len(names) * scale), 32))
            picks = np.sort(np.random.choice(len(names), n, replace=n > len(names)))
        else:
            picks = np.arange(min(len(names), self.max_frames))
        frames = [np.asarray(Image.open(os.path.join(frame_dir, names[i])).convert("RGB")) for i in picks]
        video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255.0
        if self.train:
            top, left = random.randint(0, 256 - self.size), random.randint(0, 256 - self.size)
        else:
            top = left = (256 - self.size) // 2
        video = video[:, :, top:top + self.size, left:left + self.size]
        if self.train and random.random() < 0.5:
            video = video.flip(-1)
        video = (video - MEAN) / STD
        target = torch.tensor([self.gloss2id[g] for g in item["glosses"] if g in self.gloss2id], dtype=torch.long)
        return video, target, item["id"]


def collate(batch):
    batch.sort(key=lambda b: b[0].shape[0], reverse=True)
    videos, targets, ids = zip(*batch)
    lengths = torch.tensor([v.shape[0] for v in videos])
    padded = videos[0].new_zeros((len(videos), lengths.max()) + videos[0].shape[1:])
    for i, v in enumerate(videos):
        padded[i, :v.shape[0]] = v
        padded[i, v.shape[0]:] = v[-1:]  # repeat last frame
    target_lengths = torch.tensor([len(t) for t in targets])
    return padded, lengths, torch.cat(targets), target_lengths, list(ids)


class SLRModel(nn.Module):
    def __init__(self, num_classes, hidden=1024):
        super().__init__()
        backbone = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.temporal = nn.Sequential(
            nn.Conv1d(512, hidden, 5), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.MaxPool1d(2),
            nn.Conv1d(hidden, hidden, 5), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.MaxPool1d(2))
        self.rnn = nn.LSTM(hidden, hidden // 2, num_layers=2, bidirectional=True, batch_first=True)
        self.classifier = nn.Linear(hidden, num_classes)

    @staticmethod
    def out_lengths(lengths):
        for _ in range(2):
            lengths = torch.div(lengths - 4, 2, rounding_mode="floor")
        return lengths

    def forward(self, video, lengths):
        b, t = video.shape[:2]
        feats = self.backbone(video.flatten(0, 1)).view(b, t, -1)
        feats = self.temporal(feats.transpose(1, 2)).transpose(1, 2)
        out_len = self.out_lengths(lengths)
        packed = nn.utils.rnn.pack_padded_sequence(feats, out_len.cpu(), batch_first=True, enforce_sorted=True)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=feats.shape[1])
        return self.classifier(out), out_len


def greedy_decode(logits, lengths, blank=0):
    hyps = []
    best = logits.argmax(-1).cpu()
    for seq, n in zip(best, lengths.cpu()):
        seq = torch.unique_consecutive(seq[:n]).tolist()
        hyps.append([s for s in seq if s != blank])
    return hyps


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    errors, words = 0, 0
    for video, lengths, targets, target_lengths, _ in loader:
        logits, out_len = model(video.to(device, non_blocking=True), lengths.to(device))
        hyps = greedy_decode(logits, out_len)
        refs = torch.split(targets, target_lengths.tolist())
        for hyp, ref in zip(hyps, refs):
            errors += editdistance.eval(hyp, ref.tolist())
            words += len(ref)
    totals = torch.tensor([errors, words], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return 100.0 * totals[0].item() / max(totals[1].item(), 1)


class ShardSampler(torch.utils.data.Sampler):
    """Deterministic, non-padded split of an evaluation set over ranks."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--out", default="runs/phoenix_r18")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2, help="videos per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data_root, "gloss_dict.json")) as f:
        gloss2id = json.load(f)  # blank is 0, glosses start at 1
    num_classes = len(gloss2id) + 1

    train_set = PhoenixVideos(args.data_root, "train", gloss2id, train=True)
    dev_set = PhoenixVideos(args.data_root, "dev", gloss2id, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=1, sampler=ShardSampler(len(dev_set), rank, world_size),
                            collate_fn=collate, num_workers=4, pin_memory=True)

    model = SLRModel(num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 35], gamma=0.2)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    scaler = torch.cuda.amp.GradScaler()

    best_wer = float("inf")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for step, (video, lengths, targets, target_lengths, _) in enumerate(train_loader):
            video = video.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, out_len = model(video, lengths.to(device))
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # T, N, C
            loss = ctc(log_probs, targets.to(device), out_len, target_lengths.to(device))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.3f", epoch, step, len(train_loader), loss.item())
        scheduler.step()

        wer = evaluate(model, dev_loader, device)
        log.info("epoch %d dev WER %.2f", epoch, wer)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "wer": wer, "gloss2id": gloss2id}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    log.info("best dev WER %.2f", best_wer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
