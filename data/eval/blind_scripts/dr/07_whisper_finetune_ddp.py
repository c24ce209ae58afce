#!/usr/bin/env python3
"""Domain adaptation of Whisper on medical dictation data (seq2seq CE loss, greedy decoding for WER).

Usage:
  torchrun --nnodes=1 --nproc_per_node=4 07_whisper_finetune_ddp.py \
      --train-jsonl data/dictation_train.jsonl --dev-jsonl data/dictation_dev.jsonl \
      --model openai/whisper-small.en --out-dir exp/whisper_small_dictation
"""
import argparse
import json
import logging
import os
import time

import librosa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperTokenizer
from transformers.models.whisper.english_normalizer import EnglishTextNormalizer
import jiwer

LOG = logging.getLogger("whisper-ft")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train-jsonl", required=True)
    p.add_argument("--dev-jsonl", required=True)
    p.add_argument("--model", default="openai/whisper-small.en")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=1.25e-5)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--max-steps", type=int, default=12000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--spec-augment", action="store_true")
    p.add_argument("--num-workers", type=int, default=8)
    return p.parse_args()


class JsonlSpeech(Dataset):
    def __init__(self, path, fe, tok):
        with open(path) as f:
            self.items = [json.loads(x) for x in f if x.strip()]
        self.fe, self.tok = fe, tok

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        audio, _ = librosa.load(it["audio"], sr=16000)
        feats = self.fe(audio, sampling_rate=16000, return_tensors="pt").input_features[0]
        ids = self.tok(it["text"]).input_ids
        return {"input_features": feats, "labels": ids, "text": it["text"]}


def make_collate(decoder_start_id):
    def collate(batch):
        feats = torch.stack([b["input_features"] for b in batch])
        L = max(len(b["labels"]) for b in batch)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        for i, b in enumerate(batch):
            labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
        if (labels[:, 0] == decoder_start_id).all():
            labels = labels[:, 1:]
        return feats, labels, [b["text"] for b in batch]
    return collate


def lr_at(step, base, warmup, total):
    if step < warmup:
        return base * (step + 1) / warmup
    return base * max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def evaluate(model, loader, tok, normalizer, device):
    model.eval()
    counts = torch.zeros(2, device=device, dtype=torch.float64)
    for feats, _, texts in loader:
        feats = feats.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model.generate(input_features=feats, max_new_tokens=224, num_beams=1)
        hyps = tok.batch_decode(pred, skip_special_tokens=True)
        for ref, hyp in zip(texts, hyps):
            r, h = normalizer(ref), normalizer(hyp)
            if not r:
                continue
            m = jiwer.process_words(r, h)
            counts[0] += m.substitutions + m.deletions + m.insertions
            counts[1] += len(r.split())
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(name)s: %(message)s")

    fe = WhisperFeatureExtractor.from_pretrained(args.model)
    tok = WhisperTokenizer.from_pretrained(args.model)
    normalizer = EnglishTextNormalizer(tok.english_spelling_normalizer)
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    if args.spec_augment:
        model.config.apply_spec_augment = True
        model.config.mask_time_prob = 0.05
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    collate = make_collate(model.module.config.decoder_start_token_id)
    train_ds = JsonlSpeech(args.train_jsonl, fe, tok)
    dev_ds = JsonlSpeech(args.dev_jsonl, fe, tok)
    dev_ds.items = dev_ds.items[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=24, shuffle=False, collate_fn=collate, num_workers=4)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()

    step, epoch, best_wer = 0, 0, float("inf")
    t_start = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for feats, labels, _ in train_dl:
            for g in optim.param_groups:
                g["lr"] = lr_at(step, args.lr, args.warmup_steps, args.max_steps)
            feats, labels = feats.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_features=feats, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                LOG.info("step %d/%d loss %.4f scale %.0f elapsed %.0fs", step, args.max_steps, loss.item(),
                         scaler.get_scale(), time.time() - t_start)

            if step % args.eval_every == 0 or step == args.max_steps:
                wer = evaluate(model, dev_dl, tok, normalizer, device)
                LOG.info("step %d dev WER %.2f%%", step, 100 * wer)
                if rank == 0:
                    ck = os.path.join(args.out_dir, f"step{step}")
                    model.module.save_pretrained(ck)
                    fe.save_pretrained(ck)
                    tok.save_pretrained(ck)
                    if wer < best_wer:
                        best_wer = wer
                        with open(os.path.join(args.out_dir, "best.txt"), "w") as f:
                            f.write(f"{ck}\t{wer:.4f}\n")
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    LOG.info("done, best dev WER %.2f%%", 100 * best_wer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
