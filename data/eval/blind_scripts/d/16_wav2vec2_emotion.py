#!/usr/bin/env python
"""
Speech emotion recognition: fine-tune wav2vec2-base (Wav2Vec2ForSequenceClassification) on
IEMOCAP / RAVDESS-style CSVs (path,label). Long utterances, so activations are checkpointed.

    torchrun --nproc_per_node=4 16_wav2vec2_emotion.py --train train.csv --valid valid.csv
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoFeatureExtractor, Wav2Vec2ForSequenceClassification, get_linear_schedule_with_warmup

LABELS = ["neutral", "happy", "sad", "angry"]


class EmotionCSV(Dataset):
    def __init__(self, csv_path, max_seconds, train):
        df = pd.read_csv(csv_path)
        df = df[df["label"].isin(LABELS)].reset_index(drop=True)
        self.paths = df["path"].tolist()
        self.labels = [LABELS.index(l) for l in df["label"]]
        self.max_len = int(max_seconds * 16000)
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, sr = sf.read(self.paths[i], dtype="float32")
        if wav.ndim == 2:
            wav = wav.mean(1)
        assert sr == 16000, f"{self.paths[i]} is {sr} Hz"
        if len(wav) > self.max_len:
            start = random.randint(0, len(wav) - self.max_len) if self.train else 0
            wav = wav[start:start + self.max_len]
        return wav, self.labels[i]


class Collator:
    def __init__(self, extractor):
        self.fx = extractor

    def __call__(self, batch):
        wavs, labels = zip(*batch)
        feats = self.fx(list(wavs), sampling_rate=16000, padding=True, return_attention_mask=True,
                        return_tensors="pt")
        return feats["input_values"], feats["attention_mask"], torch.tensor(labels)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(len(LABELS), len(LABELS), device=device, dtype=torch.long)
    for x, mask, y in loader:
        x, mask, y = x.to(device), mask.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_values=x, attention_mask=mask).logits
        pred = logits.argmax(-1)
        conf += torch.bincount(y * len(LABELS) + pred, minlength=len(LABELS) ** 2).view(len(LABELS), -1)
    dist.all_reduce(conf)
    wa = (conf.diag().sum() / conf.sum()).item()
    ua = (conf.diag() / conf.sum(1).clamp(min=1)).mean().item()
    model.train()
    return wa, ua


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--model", default="facebook/wav2vec2-base")
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-5, help="for a total batch of 32")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--max-seconds", type=float, default=12.0)
    ap.add_argument("--out", default="ckpt/w2v2-ser")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    extractor = AutoFeatureExtractor.from_pretrained(args.model)
    train_ds = EmotionCSV(args.train, args.max_seconds, train=True)
    valid_ds = EmotionCSV(args.valid, args.max_seconds, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              collate_fn=Collator(extractor), pin_memory=True, drop_last=True)
    valid_loader = DataLoader(Subset(valid_ds, list(range(rank, len(valid_ds), world))), batch_size=8,
                              num_workers=4, collate_fn=Collator(extractor))

    model = Wav2Vec2ForSequenceClassification.from_pretrained(
        args.model, num_labels=len(LABELS), layerdrop=0.05, mask_time_prob=0.05,
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)})
    model.freeze_feature_encoder()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.to(device)
    # layerdrop skips random transformer layers, so some parameters get no gradient in a step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    best_ua, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, mask, y in train_loader:
            x, mask, y = x.to(device, non_blocking=True), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_values=x, attention_mask=mask).logits
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(loss_sum)
        wa, ua = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f} WA {wa:.4f} UA {ua:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if ua > best_ua:
                best_ua = ua
                model.module.save_pretrained(args.out)
                extractor.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
