#!/usr/bin/env python
"""HuBERT-large CTC fine-tuning (LibriLight 10h / LibriSpeech 100h) with preemption-safe checkpoints.

Jobs run on a preemptible queue, so the script checkpoints every epoch and resumes from
<exp>/checkpoint.pt automatically when it exists.

    torchrun --nproc_per_node=8 12_hubert_ctc_resume.py --exp exp/hubert_large_ll10h \
        --train data/ll10h.jsonl --valid data/dev_other.jsonl --vocab data/vocab.json
"""
import argparse
import json
import logging
import os
import sys
import time

import editdistance
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    HubertForCTC,
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2Processor,
    get_linear_schedule_with_warmup,
)

log = logging.getLogger("hubert_ctc")


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--exp", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--init", default="facebook/hubert-large-ll60k")
    p.add_argument("--bsz", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--max_seconds", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=4)
    return p


class JsonlASR(Dataset):
    def __init__(self, path, processor, max_seconds=None):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if max_seconds is None or r["duration"] <= max_seconds]
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio_filepath"], dtype="float32")
        return {
            "input_values": self.processor(wav, sampling_rate=sr).input_values[0],
            "labels": self.processor.tokenizer(r["text"].upper()).input_ids,
            "ref": r["text"].upper(),
        }


def make_collator(processor):
    def collate(items):
        batch = processor.feature_extractor.pad([{"input_values": x["input_values"]} for x in items],
                                                padding=True, return_attention_mask=True, return_tensors="pt")
        lab = processor.tokenizer.pad([{"input_ids": x["labels"]} for x in items], return_tensors="pt")
        batch["labels"] = lab["input_ids"].masked_fill(lab["attention_mask"].eq(0), -100)
        return dict(batch), [x["ref"] for x in items]
    return collate


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def valid_wer(model, loader, processor, device):
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for batch, refs in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        logits = model(**batch).logits
        for ref, hyp in zip(refs, processor.batch_decode(logits.argmax(-1))):
            tot[0] += editdistance.eval(ref.split(), hyp.split())
            tot[1] += len(ref.split())
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = build_parser().parse_args()
    local_rank, rank, world = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    tok = Wav2Vec2CTCTokenizer(args.vocab, unk_token="<unk>", pad_token="<pad>", word_delimiter_token="|")
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                  return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=fe, tokenizer=tok)

    train_set = JsonlASR(args.train, processor, args.max_seconds)
    valid_set = JsonlASR(args.valid, processor)
    valid_set.rows = valid_set.rows[rank::world]
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    collate = make_collator(processor)
    train_loader = DataLoader(train_set, batch_size=args.bsz, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=16, collate_fn=collate, num_workers=2)

    model = HubertForCTC.from_pretrained(
        args.init, vocab_size=len(tok), pad_token_id=tok.pad_token_id, ctc_loss_reduction="mean",
        ctc_zero_infinity=True, mask_time_prob=0.075, layerdrop=0.0, final_dropout=0.0,
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                 betas=(0.9, 0.98), eps=1e-8)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    ckpt_path = os.path.join(args.exp, "checkpoint.pt")
    start_epoch, best_wer = 0, float("inf")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_wer = ckpt["epoch"] + 1, ckpt["best_wer"]
        log.info("resumed from %s (epoch %d, best WER %.4f)", ckpt_path, ckpt["epoch"], best_wer)
        del ckpt

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        processor.save_pretrained(args.exp)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for it, (batch, _) in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen += batch["input_values"].size(0)
            if it % 50 == 0:
                log.info("ep %d it %d/%d loss %.3f lr %.2e %.1f utt/s/gpu", epoch, it, len(train_loader),
                         loss.item(), scheduler.get_last_lr()[0], seen / (time.time() - t0))

        wer = valid_wer(model.module, valid_loader, processor, device)
        log.info("epoch %d valid WER %.2f%%", epoch, 100 * wer)
        if rank == 0:
            if wer < best_wer:
                best_wer = wer
                model.module.save_pretrained(os.path.join(args.exp, "best"))
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best_wer": best_wer}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
