#!/usr/bin/env python3
# Copyright    2023  (authors: speech team)
"""
Conformer transducer (torchaudio) on TED-LIUM 3, BPE 500.

Usage:
    torchrun --nproc_per_node 4 16_conformer_rnnt_avg.py \
        --exp-dir conformer_rnnt/exp --num-epochs 30 --avg 8 --max-duration 200
"""
import argparse
import json
import logging
import os
import random
from pathlib import Path
from typing import Dict, List

import sentencepiece as spm
import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--bpe-model", type=str, default="data/lang_bpe_500/bpe.model")
    parser.add_argument("--exp-dir", type=Path, default=Path("conformer_rnnt/exp"))
    parser.add_argument("--num-epochs", type=int, default=30)
    parser.add_argument("--start-epoch", type=int, default=1)
    parser.add_argument("--avg", type=int, default=8, help="number of last epoch checkpoints to average")
    parser.add_argument("--max-duration", type=float, default=200.0)
    parser.add_argument("--base-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    return parser


class CutDataset(Dataset):
    def __init__(self, manifest: Path, sp):
        self.cuts = [json.loads(l) for l in manifest.open()]
        self.sp = sp
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.cuts)

    def __getitem__(self, i):
        c = self.cuts[i]
        wav, _ = torchaudio.load(c["recording"], frame_offset=int(c["start"] * 16000),
                                 num_frames=int(c["duration"] * 16000))
        feats = (self.mel(wav[0]) + 1e-6).log().T
        return feats, torch.tensor(self.sp.encode(c["text"]), dtype=torch.int32)


class SyncedBucketSampler(Sampler):
    """All ranks build the same list of duration-capped batches, then take every world_size-th one.
    The list is truncated to a multiple of world_size so every rank runs the same number of steps."""

    def __init__(self, durations: List[float], max_duration: float, world_size: int, rank: int, seed: int = 0):
        self.durations = durations
        self.max_duration = max_duration
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        idx = sorted(range(len(self.durations)), key=lambda i: self.durations[i])
        batches, cur, tot = [], [], 0.0
        for i in idx:
            if cur and tot + self.durations[i] > self.max_duration:
                batches.append(cur)
                cur, tot = [], 0.0
            cur.append(i)
            tot += self.durations[i]
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        n = len(batches) // self.world_size * self.world_size
        return batches[:n][self.rank::self.world_size]

    def __iter__(self):
        yield from self._batches()

    def __len__(self):
        return len(self._batches())


def collate(batch):
    feats, toks = zip(*batch)
    return (torch.nn.utils.rnn.pad_sequence(feats, batch_first=True),
            torch.tensor([f.size(0) for f in feats], dtype=torch.int32),
            torch.nn.utils.rnn.pad_sequence(toks, batch_first=True),
            torch.tensor([t.size(0) for t in toks], dtype=torch.int32))


def save_checkpoint(filename: Path, model, optimizer, scheduler, epoch: int, rank: int):
    if rank != 0:
        return
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch}, filename)


def average_checkpoints(filenames: List[Path]) -> Dict[str, torch.Tensor]:
    n = len(filenames)
    avg = torch.load(filenames[0], map_location="cpu")["model"]
    for f in filenames[1:]:
        sd = torch.load(f, map_location="cpu")["model"]
        for k in avg:
            avg[k] += sd[k]
    for k in avg:
        if avg[k].is_floating_point():
            avg[k] /= n
        else:
            avg[k] //= n
    return avg


def compute_loss(model, feats, feat_lens, tokens, token_lens, blank_id, device):
    feats, feat_lens = feats.to(device), feat_lens.to(device)
    tokens, token_lens = tokens.to(device), token_lens.to(device)
    prepended = torch.nn.functional.pad(tokens, (1, 0), value=blank_id)
    logits, src_lens, _, _ = model(feats, feat_lens, prepended, token_lens + 1)
    loss = torchaudio.functional.rnnt_loss(logits.float(), tokens, src_lens.int(), token_lens,
                                           blank=blank_id, reduction="sum")
    return loss, token_lens.sum()


def run(args):
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(format="%(asctime)s %(levelname)s [%(filename)s:%(lineno)d] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0:
        args.exp_dir.mkdir(parents=True, exist_ok=True)

    sp = spm.SentencePieceProcessor(model_file=args.bpe_model)
    blank_id = sp.piece_to_id("<blk>")
    vocab_size = sp.get_piece_size()

    train = CutDataset(args.manifest_dir / "tedlium_cuts_train.jsonl", sp)
    dev = CutDataset(args.manifest_dir / "tedlium_cuts_dev.jsonl", sp)
    train_sampler = SyncedBucketSampler([c["duration"] for c in train.cuts], args.max_duration, world_size, rank,
                                        args.seed)
    dev_sampler = SyncedBucketSampler([c["duration"] for c in dev.cuts], args.max_duration, world_size, rank)
    train_dl = DataLoader(train, batch_sampler=train_sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = torchaudio.models.conformer_rnnt_base()
    model.joiner.linear = torch.nn.Linear(model.joiner.linear.in_features, vocab_size)
    model.predictor.embedding = torch.nn.Embedding(vocab_size, model.predictor.embedding.embedding_dim)
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.base_lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.base_lr,
                                                    total_steps=args.num_epochs * len(train_dl), pct_start=0.15)

    if args.start_epoch > 1:
        ckpt = torch.load(args.exp_dir / f"epoch-{args.start_epoch - 1}.pt", map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    for epoch in range(args.start_epoch, args.num_epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch_idx, batch in enumerate(train_dl):
            loss, ntok = compute_loss(model, *batch, blank_id, device)
            optimizer.zero_grad()
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if batch_idx % 50 == 0:
                logging.info(f"Epoch {epoch}, batch {batch_idx}, loss/token {(loss / ntok).item():.4f}, "
                             f"lr {scheduler.get_last_lr()[0]:.2e}")

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in dev_dl:
                loss, ntok = compute_loss(model.module, *batch, blank_id, device)
                tot[0] += loss
                tot[1] += ntok
        dist.all_reduce(tot)
        logging.info(f"Epoch {epoch}, dev loss/token {(tot[0] / tot[1]).item():.4f}")

        save_checkpoint(args.exp_dir / f"epoch-{epoch}.pt", model, optimizer, scheduler, epoch, rank)

    start = max(1, args.num_epochs - args.avg + 1)
    filenames = [args.exp_dir / f"epoch-{i}.pt" for i in range(start, args.num_epochs + 1)]
    logging.info(f"Averaging {[f.name for f in filenames]}")
    avg = average_checkpoints(filenames)
    torch.save({"model": avg}, args.exp_dir / f"pretrained-avg-{args.avg}.pt")
    logging.info("Done!")

    dist.destroy_process_group()


def main():
    args = get_parser().parse_args()
    run(args)


if __name__ == "__main__":
    main()
