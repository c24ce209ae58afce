"""XLS-R CTC fine-tuning with duration-bucketed batches (multilingual, shared char vocab).

    torchrun --standalone --nproc_per_node=8 06_xlsr_ctc_bucketed.py \
        --train data/mls_train.tsv --valid data/mls_dev.tsv --tokenizer_dir data/tok_mls \
        --save_dir exp/xlsr1b_mls

TSV: audio_path \t num_samples \t transcript
"""
import argparse
import csv
import logging
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor, get_polynomial_decay_schedule_with_warmup
import editdistance

logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s", level=logging.INFO)
log = logging.getLogger("xlsr")


@dataclass
class Row:
    path: str
    n_samples: int
    text: str


def load_rows(path, max_samples=None):
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for p, n, t in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            n = int(n)
            if max_samples and n > max_samples:
                continue
            rows.append(Row(p, n, t))
    return rows


class SpeechDataset(Dataset):
    def __init__(self, rows, processor):
        self.rows = rows
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        r = self.rows[idx]
        wav, _ = sf.read(r.path, dtype="float32")
        wav = (wav - wav.mean()) / np.sqrt(wav.var() + 1e-7)
        return torch.from_numpy(wav), torch.tensor(self.processor.tokenizer(r.text).input_ids), r.text


def collate_fn(batch):
    wavs, labels, texts = zip(*batch)
    lengths = torch.tensor([w.numel() for w in wavs])
    input_values = torch.zeros(len(wavs), int(lengths.max()))
    attention_mask = torch.zeros(len(wavs), int(lengths.max()), dtype=torch.long)
    for i, w in enumerate(wavs):
        input_values[i, : w.numel()] = w
        attention_mask[i, : w.numel()] = 1
    label_pad = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
    return {"input_values": input_values, "attention_mask": attention_mask, "labels": label_pad}, list(texts)


class BucketBatchSampler(BatchSampler):
    """Sort by length into buckets of `bucket_size` batches, shuffle inside and across buckets."""

    def __init__(self, lengths, batch_size, bucket_size=100, drop_last=True, seed=0):
        self.lengths = lengths
        self.batch_size = batch_size
        self.bucket_size = bucket_size
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        chunk = self.batch_size * self.bucket_size
        batches = []
        for start in range(0, len(idx), chunk):
            bucket = sorted(idx[start:start + chunk], key=lambda i: self.lengths[i])
            for b in range(0, len(bucket), self.batch_size):
                batch = bucket[b:b + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        rng.shuffle(batches)
        return iter(batches)

    def __len__(self):
        if self.drop_last:
            return len(self.lengths) // self.batch_size
        return math.ceil(len(self.lengths) / self.batch_size)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--tokenizer_dir", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--pretrained", default="facebook/wav2vec2-xls-r-1b")
    ap.add_argument("--batch_size", type=int, default=6)
    ap.add_argument("--max_seconds", type=float, default=20.0)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max_epochs", type=int, default=15)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


@torch.no_grad()
def validate(model, loader, processor, device):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)  # edits, ref words, loss sum
    for batch, texts in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        acc[2] += out.loss.float() * len(texts)
        hyps = processor.batch_decode(out.logits.argmax(-1))
        for ref, hyp in zip(texts, hyps):
            acc[0] += editdistance.eval(ref.split(), hyp.split())
            acc[1] += len(ref.split())
    n_utts = torch.tensor([len(loader.dataset)], dtype=torch.float64, device=device)
    dist.all_reduce(acc)
    dist.all_reduce(n_utts)
    model.train()
    return (acc[0] / acc[1]).item(), (acc[2] / n_utts).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        log.setLevel(logging.WARNING)

    processor = Wav2Vec2Processor.from_pretrained(args.tokenizer_dir)
    max_samples = int(args.max_seconds * 16000)
    train_rows = load_rows(args.train, max_samples)
    valid_rows = load_rows(args.valid)
    log.info("%d train / %d valid utterances on %d GPUs", len(train_rows), len(valid_rows), world_size)

    train_set = SpeechDataset(train_rows, processor)
    batch_sampler = BucketBatchSampler([r.n_samples for r in train_rows], args.batch_size, seed=1)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=collate_fn,
                              num_workers=args.workers, pin_memory=True, prefetch_factor=4)
    valid_rows = sorted(valid_rows, key=lambda r: r.n_samples)[rank::world_size]
    valid_loader = DataLoader(SpeechDataset(valid_rows, processor), batch_size=8, collate_fn=collate_fn,
                              num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.pretrained, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, layerdrop=0.0, mask_time_prob=0.075,
        mask_time_length=10, mask_feature_prob=0.004, mask_feature_length=64, final_dropout=0.0,
    )
    model.freeze_feature_encoder()
    model = DDP(model.to(device), device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or n.endswith(".bias") else decay).append(p)
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    total = args.max_epochs * len(train_loader)
    sched = get_polynomial_decay_schedule_with_warmup(optim, args.warmup, total, lr_end=1e-7)

    os.makedirs(args.save_dir, exist_ok=True)
    best = float("inf")
    step = 0
    for epoch in range(1, args.max_epochs + 1):
        batch_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for i, (batch, _) in enumerate(train_loader, 1):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            running += loss.item()
            step += 1
            if i % 100 == 0:
                log.info("epoch %d [%d/%d] loss %.3f lr %.2e", epoch, i, len(train_loader), running / 100,
                         sched.get_last_lr()[0])
                running = 0.0

        wer, vloss = validate(model.module, valid_loader, processor, device)
        log.info("epoch %d | valid loss %.4f | WER %.2f", epoch, vloss, 100 * wer)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optim": optim.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if wer < best:
                best = wer
                model.module.save_pretrained(os.path.join(args.save_dir, "best"))
                processor.save_pretrained(os.path.join(args.save_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
