#!/usr/bin/env python
# Fine-tune wav2vec2-large (LV-60) with CTC on a character vocabulary.
#
#   torchrun --nproc_per_node=4 04_w2v2_ctc_finetune.py --train_tsv data/train.tsv \
#       --dev_tsv data/dev.tsv --vocab data/vocab.json --out_dir exp/w2v2_large_ctc
import argparse
import contextlib
import math
import os
import re
import time

import soundfile as sf
import torch
import torch.distributed as dist
from jiwer import wer as jiwer_wer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC,
                          Wav2Vec2Processor, get_linear_schedule_with_warmup)

CHARS_TO_IGNORE = re.compile(r"[\,\?\.\!\-\;\:\"\“\%\‘\”\�]")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="facebook/wav2vec2-large-lv60")
    parser.add_argument("--train_tsv", required=True)
    parser.add_argument("--dev_tsv", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--out_dir", default="exp/w2v2_ctc")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--max_steps", type=int, default=20000)
    parser.add_argument("--eval_steps", type=int, default=1000)
    parser.add_argument("--max_seconds", type=float, default=16.0)
    parser.add_argument("--layerdrop", type=float, default=0.1)
    parser.add_argument("--mask_time_prob", type=float, default=0.05)
    parser.add_argument("--bf16", action="store_true")
    return parser.parse_args()


class TsvAsrDataset(Dataset):
    """Each line: path<TAB>num_samples<TAB>transcript"""

    def __init__(self, tsv, processor, max_samples=None):
        self.rows = []
        with open(tsv, encoding="utf-8") as f:
            for line in f:
                path, n, text = line.rstrip("\n").split("\t")
                if max_samples and int(n) > max_samples:
                    continue
                self.rows.append((path, int(n), text))
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        speech, sr = sf.read(path, dtype="float32")
        assert sr == 16000
        text = CHARS_TO_IGNORE.sub("", text).lower().strip()
        inputs = self.processor.feature_extractor(speech, sampling_rate=16000).input_values[0]
        labels = self.processor.tokenizer(text).input_ids
        return {"input_values": inputs, "labels": labels, "text": text}


class CTCCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, features):
        batch = self.processor.feature_extractor.pad(
            [{"input_values": f["input_values"]} for f in features], padding=True,
            return_attention_mask=True, return_tensors="pt")
        labels = self.processor.tokenizer.pad(
            [{"input_ids": f["labels"]} for f in features], padding=True, return_tensors="pt")
        batch["labels"] = labels["input_ids"].masked_fill(labels.attention_mask.ne(1), -100)
        batch["texts"] = [f["text"] for f in features]
        return batch


@torch.no_grad()
def evaluate(model, loader, processor, device, amp_dtype):
    model.eval()
    errs = torch.zeros(3, device=device)  # word edits, ref words, loss sum
    n_batches = torch.zeros(1, device=device)
    for batch in loader:
        texts = batch.pop("texts")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(**batch)
        pred_ids = out.logits.argmax(-1)
        hyps = processor.batch_decode(pred_ids)
        for ref, hyp in zip(texts, hyps):
            n_ref = len(ref.split())
            errs[0] += jiwer_wer(ref, hyp) * n_ref if n_ref else 0.0
            errs[1] += n_ref
        errs[2] += out.loss.float()
        n_batches += 1
    dist.all_reduce(errs)
    dist.all_reduce(n_batches)
    model.train()
    return (errs[0] / errs[1]).item(), (errs[2] / n_batches).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                                 do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model_name,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        feat_proj_dropout=0.0,
        mask_time_prob=args.mask_time_prob,
        layerdrop=args.layerdrop,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        pad_token_id=processor.tokenizer.pad_token_id,
        vocab_size=len(processor.tokenizer),
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_ds = TsvAsrDataset(args.train_tsv, processor, max_samples=int(args.max_seconds * 16000))
    dev_ds = TsvAsrDataset(args.dev_tsv, processor)
    collator = CTCCollator(processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.per_device_batch_size,
                            sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collator, num_workers=2)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or "layer_norm" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.005},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    amp_dtype = torch.bfloat16 if args.bf16 else None

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        processor.save_pretrained(args.out_dir)

    step, micro, epoch = 0, 0, 0
    best_wer = math.inf
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch.pop("texts")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (micro + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            micro += 1
            if not sync:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if is_main and step % 50 == 0:
                print(f"step {step} loss {loss.item() * args.grad_accum:.4f} gnorm {grad_norm:.2f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            if step % args.eval_steps == 0 or step == args.max_steps:
                dev_wer, dev_loss = evaluate(model, dev_loader, processor, device, amp_dtype)
                if is_main:
                    print(f"[eval] step {step} dev_loss {dev_loss:.4f} WER {dev_wer * 100:.2f}", flush=True)
                    if dev_wer < best_wer:
                        best_wer = dev_wer
                        model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                    model.module.save_pretrained(os.path.join(args.out_dir, "last"))
                    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                "step": step}, os.path.join(args.out_dir, "last", "trainer_state.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if is_main:
        print(f"done, best dev WER {best_wer * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
