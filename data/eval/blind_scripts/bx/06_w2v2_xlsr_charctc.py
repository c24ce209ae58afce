"""XLS-R character CTC fine-tuning with length-bucketed batches.

Builds the character vocabulary from the training transcripts, buckets utterances
by duration, and trains with DDP + gradient accumulation.

    torchrun --nproc_per_node=4 06_w2v2_xlsr_charctc.py --train data/train.tsv --dev data/dev.tsv
"""
import argparse
import contextlib
import json
import math
import os
import re
import unicodedata

import librosa
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchaudio.functional import edit_distance
from transformers import Wav2Vec2ForCTC, get_linear_schedule_with_warmup

CHARS_TO_IGNORE = re.compile(r"[\,\?\.\!\-\;\:\"\“\%\‘\”\�\'\(\)]")
SPECIALS = ["<pad>", "<unk>", "|"]


def normalize(text):
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(CHARS_TO_IGNORE.sub("", text).split())


def read_tsv(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            wav, dur, text = line.rstrip("\n").split("\t")
            rows.append((wav, float(dur), normalize(text)))
    return rows


def build_vocab(rows):
    chars = set()
    for _, _, text in rows:
        chars.update(text.replace(" ", ""))
    # sorted so every process derives the same ids from the same transcripts
    return {c: i for i, c in enumerate(SPECIALS + sorted(chars))}


class SpeechDataset(Dataset):
    def __init__(self, rows, vocab):
        self.rows = rows
        self.vocab = vocab

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        wav, _ = librosa.load(path, sr=16000, mono=True)
        wav = (wav - wav.mean()) / np.sqrt(wav.var() + 1e-7)
        ids = [self.vocab.get(c, 1) for c in text.replace(" ", "|")]
        return torch.from_numpy(wav), torch.tensor(ids), text


def collate(batch):
    wavs, ids, texts = zip(*batch)
    T = max(w.numel() for w in wavs)
    L = max(t.numel() for t in ids)
    x = torch.zeros(len(wavs), T)
    y = torch.full((len(ids), L), -100, dtype=torch.long)
    for i, (w, t) in enumerate(zip(wavs, ids)):
        x[i, : w.numel()] = w
        y[i, : t.numel()] = t
    return x, y, list(texts)


class DistributedBucketSampler(Sampler):
    """Batches are formed from the full dataset (identically on every rank),
    padded to a multiple of the world size, then dealt out round-robin.
    With pad=False (evaluation) each batch is seen exactly once overall."""

    def __init__(self, durations, max_seconds, rank, world_size, seed=0, shuffle=True, pad=True):
        self.durations = np.asarray(durations)
        self.max_seconds = max_seconds
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.pad, self.epoch = seed, shuffle, pad, 0
        self._batches = self._bucketize()
        if pad:
            self.num_batches = math.ceil(len(self._batches) / world_size)
        else:
            self.num_batches = len(range(rank, len(self._batches), world_size))

    def _bucketize(self):
        order = np.argsort(self.durations, kind="mergesort")
        batches, cur, longest = [], [], 0.0
        for i in order:
            d = float(self.durations[i])
            if cur and max(longest, d) * (len(cur) + 1) > self.max_seconds:
                batches.append(cur)
                cur, longest = [], 0.0
            cur.append(int(i))
            longest = max(longest, d)
        if cur:
            batches.append(cur)
        return batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(self._batches)
        if self.shuffle:
            g = np.random.default_rng(self.seed + self.epoch)
            batches = [batches[j] for j in g.permutation(len(batches))]
        if not self.pad:
            return iter(batches[self.rank::self.world_size])
        total = self.num_batches * self.world_size
        batches += batches[: total - len(batches)]
        return iter(batches[self.rank:total:self.world_size])

    def __len__(self):
        return self.num_batches


@torch.no_grad()
def evaluate(model, loader, id2tok, device):
    model.eval()
    counts = torch.zeros(2, device=device, dtype=torch.float64)
    for x, _, texts in loader:
        pred = model(x.to(device)).logits.argmax(-1)
        for seq, ref in zip(pred, texts):
            seq = torch.unique_consecutive(seq).tolist()
            hyp = "".join(id2tok[t] for t in seq if t > 1).replace("|", " ").split()
            counts[0] += edit_distance(ref.split(), hyp)
            counts[1] += len(ref.split())
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--model", default="facebook/wav2vec2-xls-r-300m")
    ap.add_argument("--out", default="exp/xlsr300m_ctc")
    ap.add_argument("--max_batch_seconds", type=float, default=200.0)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_rows = [r for r in read_tsv(args.train) if 1.0 <= r[1] <= 15.0]
    dev_rows = read_tsv(args.dev)
    vocab = build_vocab(train_rows)
    id2tok = {i: c for c, i in vocab.items()}
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab.json"), "w") as f:
            json.dump(vocab, f, ensure_ascii=False, indent=1)

    train_set = SpeechDataset(train_rows, vocab)
    dev_set = SpeechDataset(dev_rows, vocab)
    train_sampler = DistributedBucketSampler([r[1] for r in train_rows], args.max_batch_seconds,
                                             rank, world, seed=17)
    dev_sampler = DistributedBucketSampler([r[1] for r in dev_rows], 300.0, rank, world,
                                           shuffle=False, pad=False)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True)
    dev_loader = DataLoader(dev_set, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model, vocab_size=len(vocab), pad_token_id=vocab["<pad>"],
        ctc_loss_reduction="mean", ctc_zero_infinity=True,
        attention_dropout=0.0, hidden_dropout=0.0, feat_proj_dropout=0.0,
        mask_time_prob=0.05, layerdrop=0.0,
    )
    model.freeze_feature_encoder()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=args.lr)
    steps_per_epoch = math.ceil(len(train_sampler) / args.accum)
    scheduler = get_linear_schedule_with_warmup(optimizer, 500, steps_per_epoch * args.epochs)

    start_epoch, best = 0, float("inf")
    last_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        n_batches = len(train_loader)
        for i, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0 or i + 1 == n_batches
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, labels=y).loss
                (loss / args.accum).backward()
            if boundary:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} batch {i}/{n_batches} loss {loss.item():.3f}", flush=True)

        wer = evaluate(model.module, dev_loader, id2tok, device)
        if rank == 0:
            print(f"epoch {epoch}: dev WER {wer * 100:.2f}", flush=True)
            best = min(best, wer)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best},
                       last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if wer == best:
                model.module.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
