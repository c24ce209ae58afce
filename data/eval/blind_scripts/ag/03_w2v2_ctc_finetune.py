"""Fine-tune wav2vec2-base on LibriSpeech 100h with CTC (custom loop, torchrun)."""
import argparse
import contextlib
import csv
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC,
                          Wav2Vec2Processor, get_linear_schedule_with_warmup)
import jiwer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="facebook/wav2vec2-base")
    ap.add_argument("--vocab", default="data/vocab.json")
    ap.add_argument("--train_tsv", default="data/train-clean-100.tsv")
    ap.add_argument("--dev_tsv", default="data/dev-clean.tsv")
    ap.add_argument("--output_dir", default="out/w2v2_base_100h")
    ap.add_argument("--per_device_batch", type=int, default=8)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--warmup_steps", type=int, default=2000)
    ap.add_argument("--freeze_encoder_steps", type=int, default=10000)
    ap.add_argument("--layerdrop", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--max_seconds", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class TsvAsrDataset(Dataset):
    def __init__(self, tsv, processor, max_seconds=None):
        self.rows = []
        with open(tsv) as f:
            for path, n_samples, text in csv.reader(f, delimiter="\t"):
                if max_seconds and int(n_samples) > max_seconds * 16000:
                    continue
                self.rows.append((path, text))
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        wav, sr = sf.read(path, dtype="float32")
        assert sr == 16000
        inputs = self.processor(wav, sampling_rate=16000).input_values[0]
        labels = self.processor.tokenizer(text.upper()).input_ids
        return {"input_values": inputs, "labels": labels, "text": text.upper()}


class CtcCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, feats):
        batch = self.processor.pad([{"input_values": f["input_values"]} for f in feats],
                                   padding=True, return_tensors="pt")
        labels = self.processor.tokenizer.pad([{"input_ids": f["labels"]} for f in feats],
                                              padding=True, return_tensors="pt")
        batch["labels"] = labels["input_ids"].masked_fill(labels.attention_mask.ne(1), -100)
        batch["text"] = [f["text"] for f in feats]
        return batch


def shard_indices(n, rank, world):
    # contiguous-free round robin shard without padding, so each dev utterance is scored once
    return list(range(rank, n, world))


@torch.no_grad()
def run_eval(model, dataset, collator, processor, device, rank, world):
    model.eval()
    subset = torch.utils.data.Subset(dataset, shard_indices(len(dataset), rank, world))
    loader = DataLoader(subset, batch_size=16, collate_fn=collator, num_workers=2)
    errors = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        logits = model.module(batch["input_values"].to(device),
                              attention_mask=batch["attention_mask"].to(device)).logits
        pred_ids = logits.argmax(-1)
        preds = processor.batch_decode(pred_ids)
        for ref, hyp in zip(batch["text"], preds):
            out = jiwer.process_words(ref, hyp)
            errors[0] += out.substitutions + out.deletions + out.insertions
            errors[1] += len(ref.split())
    dist.all_reduce(errors, op=dist.ReduceOp.SUM)
    model.train()
    return (errors[0] / errors[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feat_ext = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                        do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=feat_ext, tokenizer=tokenizer)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model_name,
        ctc_loss_reduction="mean",
        pad_token_id=processor.tokenizer.pad_token_id,
        vocab_size=len(processor.tokenizer),
        layerdrop=args.layerdrop,
        mask_time_prob=0.05,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        feat_proj_dropout=0.0,
    )
    model.freeze_feature_encoder()
    model.to(device)
    # LayerDrop skips random transformer layers per step, so some parameters get no grad.
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_set = TsvAsrDataset(args.train_tsv, processor, args.max_seconds)
    dev_set = TsvAsrDataset(args.dev_tsv, processor)
    collator = CtcCollator(processor)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.per_device_batch, sampler=sampler,
                        collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)

    # The transformer layers are frozen for the first N updates (fairseq's freeze_finetune_updates);
    # params keep requires_grad=True so the DDP reducer sees the same set on every rank.
    head_params = [p for n, p in model.module.named_parameters() if n.startswith("lm_head")]
    body_params = [p for n, p in model.module.named_parameters()
                   if not n.startswith("lm_head") and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": head_params}, {"params": body_params}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} effective batch={args.per_device_batch * args.grad_accum * world}")

    update, micro, epoch = 0, 0, 0
    best_wer = math.inf
    model.train()
    while update < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            micro += 1
            is_update_step = micro % args.grad_accum == 0
            sync_ctx = contextlib.nullcontext() if is_update_step else model.no_sync()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(batch["input_values"].to(device, non_blocking=True),
                                attention_mask=batch["attention_mask"].to(device, non_blocking=True),
                                labels=batch["labels"].to(device, non_blocking=True))
                    loss = out.loss / args.grad_accum
                scaler.scale(loss).backward()

            if not is_update_step:
                continue

            if update < args.freeze_encoder_steps:
                for p in body_params:
                    p.grad = None
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1

            if rank == 0 and update % 50 == 0:
                print(f"update {update} loss {loss.item() * args.grad_accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} scale {scaler.get_scale():.0f}", flush=True)

            if update % args.eval_every == 0 or update == args.max_steps:
                wer = run_eval(model, dev_set, collator, processor, device, rank, world)
                if rank == 0:
                    print(f"update {update} dev WER {wer * 100:.2f}", flush=True)
                    if wer < best_wer:
                        best_wer = wer
                        model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                        processor.save_pretrained(os.path.join(args.output_dir, "best"))
                dist.barrier()

            if update >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
