# Whisper-small fine-tuning for a low-resource language (custom loop, DDP).
# We moved off Seq2SeqTrainer because we need per-language sampling weights later.
#
#   torchrun --nproc_per_node=4 13_whisper_asr_finetune_ddp.py --train_tsv data/train.tsv --dev_tsv data/dev.tsv
import argparse
import csv
import math
import os
import random

import evaluate
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_linear_schedule_with_warmup

SR = 16000


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/whisper-small")
    ap.add_argument("--language", default="swahili")
    ap.add_argument("--train_tsv", required=True)
    ap.add_argument("--dev_tsv", required=True)
    ap.add_argument("--out_dir", default="exp/whisper-small-sw")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--spec_aug", action="store_true")
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


class TsvASR(Dataset):
    """tsv: path<TAB>transcript, 16k mono wav"""

    def __init__(self, tsv, processor, max_sec=30.0):
        with open(tsv, encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        self.rows = [(p, t) for p, t in rows if t.strip()]
        self.proc = processor
        self.max_samples = int(max_sec * SR)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        wav, sr = sf.read(path, dtype="float32")
        if wav.ndim == 2:
            wav = wav.mean(1)
        wav = wav[: self.max_samples]
        feats = self.proc.feature_extractor(wav, sampling_rate=SR).input_features[0]
        labels = self.proc.tokenizer(text).input_ids
        return {"input_features": feats, "labels": labels, "text": text}


class Collator:
    def __init__(self, processor, decoder_start_token_id):
        self.proc = processor
        self.start = decoder_start_token_id

    def __call__(self, feats):
        batch = self.proc.feature_extractor.pad([{"input_features": f["input_features"]} for f in feats], return_tensors="pt")
        lab = self.proc.tokenizer.pad([{"input_ids": f["labels"]} for f in feats], return_tensors="pt")
        labels = lab["input_ids"].masked_fill(lab.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.start).all().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        batch["texts"] = [f["text"] for f in feats]
        return batch


@torch.no_grad()
def run_dev(model, processor, loader, device, rank, world):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            gen = model.generate(batch["input_features"].to(device), max_new_tokens=225)
        preds += processor.batch_decode(gen, skip_special_tokens=True)
        refs += batch["texts"]
    gathered = [None] * world
    dist.all_gather_object(gathered, (preds, refs))
    model.train()
    if rank != 0:
        return None
    all_p = [p for g in gathered for p in g[0]]
    all_r = [r for g in gathered for r in g[1]]
    n = len(loader.dataset)
    # DistributedSampler interleaves and pads; undo that so every utterance is scored once
    order = [None] * (math.ceil(n / world) * world)
    for rk, g in enumerate(gathered):
        for j, item in enumerate(zip(*g)):
            order[rk + j * world] = item
    all_p, all_r = zip(*order[:n])
    return evaluate.load("wer").compute(predictions=list(all_p), references=list(all_r))


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.generation_config.language = args.language
    model.generation_config.task = "transcribe"
    model.generation_config.forced_decoder_ids = None
    model.config.apply_spec_augment = args.spec_aug
    model.config.use_cache = False
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    collate = Collator(processor, model.config.decoder_start_token_id)
    train_ds = TsvASR(args.train_tsv, processor)
    dev_ds = TsvASR(args.dev_tsv, processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    steps = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"train utts {len(train_ds)}, dev utts {len(dev_ds)}, {steps} updates on {world} GPUs", flush=True)

    best_wer, gstep = float("inf"), 0
    for epoch in range(args.epochs):
        ddp.train()
        tot, cnt = torch.zeros(1, device=device), 0
        for i, batch in enumerate(train_dl):
            feats = batch["input_features"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp(input_features=feats, labels=labels).loss / args.grad_accum
            scaler.scale(loss).backward()
            tot += loss.detach() * args.grad_accum
            cnt += 1
            if (i + 1) % args.grad_accum:
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            gstep += 1
            if gstep % 100 == 0 and rank == 0:
                print(f"epoch {epoch} step {gstep}/{steps} loss {loss.item() * args.grad_accum:.4f}", flush=True)

        dist.all_reduce(tot)
        train_loss = tot.item() / (cnt * world)
        wer = run_dev(model, processor, dev_dl, device, rank, world)
        if rank == 0:
            print(f"== epoch {epoch}: train loss {train_loss:.4f}  dev WER {wer * 100:.2f}", flush=True)
            if wer < best_wer:
                best_wer = wer
                model.save_pretrained(os.path.join(args.out_dir, "best"))
                processor.save_pretrained(os.path.join(args.out_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
