#!/usr/bin/env python
"""Fine-tune wav2vec 2.0 (base) with CTC on LibriSpeech 960h.

Launch (one node, 8 GPUs):
    torchrun --nproc_per_node=8 01_wav2vec2_ctc_librispeech.py \
        --train_manifest data/ls960_train.jsonl --dev_manifest data/dev_clean.jsonl \
        --vocab data/vocab_char.json --output_dir exp/w2v2_base_ls960

Manifests are NeMo-style jsonl: {"audio_filepath": ..., "duration": ..., "text": ...}
"""
import argparse
import json
import logging
import math
import os
import random
import time

import editdistance
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import (
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    Wav2Vec2Processor,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger("w2v2_ctc")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="facebook/wav2vec2-base")
    p.add_argument("--train_manifest", required=True)
    p.add_argument("--dev_manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_duration", type=float, default=16.0)
    p.add_argument("--batch_size", type=int, default=8, help="utterances per GPU")
    p.add_argument("--eval_batch_size", type=int, default=16)
    p.add_argument("--num_buckets", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=1500)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--mask_time_prob", type=float, default=0.05)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


def read_manifest(path, max_duration=None):
    items = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            if max_duration is not None and ex["duration"] > max_duration:
                continue
            items.append(ex)
    return items


class AudioCTCDataset(Dataset):
    def __init__(self, items, processor):
        self.items = items
        self.processor = processor

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        ex = self.items[idx]
        audio, sr = sf.read(ex["audio_filepath"], dtype="float32")
        assert sr == 16000, f"{ex['audio_filepath']}: expected 16 kHz, got {sr}"
        input_values = self.processor(audio, sampling_rate=sr).input_values[0]
        text = ex["text"].upper()
        labels = self.processor.tokenizer(text).input_ids
        return {"input_values": input_values, "labels": labels, "text": text}


class CTCCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, features):
        batch = self.processor.feature_extractor.pad(
            [{"input_values": f["input_values"]} for f in features],
            padding=True, return_attention_mask=True, return_tensors="pt",
        )
        lab = self.processor.tokenizer.pad(
            [{"input_ids": f["labels"]} for f in features], padding=True, return_tensors="pt"
        )
        batch["labels"] = lab["input_ids"].masked_fill(lab["attention_mask"].ne(1), -100)
        batch["texts"] = [f["text"] for f in features]
        return batch


class DistributedBucketBatchSampler(Sampler):
    """Groups utterances of similar duration; every rank gets the same number of batches."""

    def __init__(self, durations, batch_size, num_buckets, rank, world_size, seed=0):
        self.durations = durations
        self.batch_size = batch_size
        self.num_buckets = num_buckets
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.durations)), key=lambda i: self.durations[i])
        bucket_size = math.ceil(len(order) / self.num_buckets)
        batches = []
        for b in range(0, len(order), bucket_size):
            bucket = order[b:b + bucket_size]
            rng.shuffle(bucket)
            batches.extend(bucket[i:i + self.batch_size] for i in range(0, len(bucket), self.batch_size))
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world_size
        return batches[:usable][self.rank::self.world_size]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        total = sum(math.ceil(len(c) / self.batch_size) for c in self._bucket_sizes())
        return total // self.world_size

    def _bucket_sizes(self):
        n = len(self.durations)
        bucket_size = math.ceil(n / self.num_buckets)
        return [range(b, min(b + bucket_size, n)) for b in range(0, n, bucket_size)]


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    errors, words, loss_sum, n = 0, 0, 0.0, 0
    for batch in loader:
        texts = batch.pop("texts")
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        loss_sum += out.loss.item()
        n += 1
        hyps = processor.batch_decode(out.logits.argmax(dim=-1))
        for ref, hyp in zip(texts, hyps):
            errors += editdistance.eval(ref.split(), hyp.split())
            words += len(ref.split())
    stats = torch.tensor([errors, words, loss_sum, n], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return stats[0].item() / max(stats[1].item(), 1.0), stats[2].item() / max(stats[3].item(), 1.0)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    train_items = read_manifest(args.train_manifest, args.max_duration)
    dev_items = read_manifest(args.dev_manifest)
    logger.info("train utts: %d, dev utts: %d, world size: %d", len(train_items), len(dev_items), world_size)

    train_sampler = DistributedBucketBatchSampler(
        [ex["duration"] for ex in train_items], args.batch_size, args.num_buckets, rank, world_size, seed=args.seed
    )
    collator = CTCCollator(processor)
    train_loader = DataLoader(
        AudioCTCDataset(train_items, processor), batch_sampler=train_sampler, collate_fn=collator,
        num_workers=args.num_workers, pin_memory=True, persistent_workers=True,
    )
    dev_order = sorted(range(len(dev_items)), key=lambda i: dev_items[i]["duration"])
    dev_shard = [dev_items[i] for i in dev_order[rank::world_size]]
    dev_loader = DataLoader(
        AudioCTCDataset(dev_shard, processor), batch_size=args.eval_batch_size, shuffle=False,
        collate_fn=collator, num_workers=2, pin_memory=True,
    )

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model_name,
        ctc_loss_reduction="mean",
        pad_token_id=processor.tokenizer.pad_token_id,
        vocab_size=len(processor.tokenizer),
        layerdrop=args.layerdrop,
        mask_time_prob=args.mask_time_prob,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        feat_proj_dropout=0.0,
        final_dropout=0.1,
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.98), weight_decay=0.005
    )
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        processor.save_pretrained(args.output_dir)

    best_wer = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch.pop("texts")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                logger.info(
                    "epoch %d step %d loss %.4f grad_norm %.2f lr %.2e (%.1fs)",
                    epoch, step, loss.item(), grad_norm.item(), scheduler.get_last_lr()[0], time.time() - t0,
                )
                t0 = time.time()

        wer, dev_loss = evaluate(model.module, dev_loader, processor, device)
        logger.info("epoch %d dev loss %.4f WER %.2f%%", epoch, dev_loss, 100 * wer)
        if is_main:
            ckpt_dir = os.path.join(args.output_dir, f"epoch{epoch}")
            model.module.save_pretrained(ckpt_dir)
            torch.save(
                {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step},
                os.path.join(ckpt_dir, "trainer_state.pt"),
            )
            if wer < best_wer:
                best_wer = wer
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                logger.info("new best WER %.2f%%", 100 * wer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
