"""CTC fine-tuning of wav2vec2 on call-centre recordings.

manifest TSV: path<TAB>transcript, audio at 16 kHz

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision fp16 14_wav2vec2_ctc_asr.py \
        --train_manifest data/train.tsv --dev_manifest data/dev.tsv --vocab data/vocab.json
"""
import argparse
import csv
import math
import os
import re

import evaluate
import soundfile as sf
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import (
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    Wav2Vec2Processor,
    get_linear_schedule_with_warmup,
)

logger = get_logger(__name__)
CHARS_TO_IGNORE = re.compile(r"[\,\?\.\!\-\;\:\"\%\(\)]")


class ManifestDataset(Dataset):
    def __init__(self, manifest, max_seconds=20.0):
        self.items = []
        with open(manifest) as f:
            for path, text in csv.reader(f, delimiter="\t"):
                if sf.info(path).duration <= max_seconds:
                    self.items.append((path, CHARS_TO_IGNORE.sub("", text).lower().strip()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        audio, sr = sf.read(path, dtype="float32")
        assert sr == 16000, f"{path}: {sr} Hz"
        return {"audio": audio, "text": text}


class CTCCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        feats = self.processor.feature_extractor([b["audio"] for b in batch], sampling_rate=16000,
                                                 padding=True, return_attention_mask=True, return_tensors="pt")
        labels = self.processor.tokenizer([b["text"] for b in batch], padding=True, return_tensors="pt")
        label_ids = labels["input_ids"].masked_fill(labels["attention_mask"].ne(1), -100)
        return {"input_values": feats["input_values"], "attention_mask": feats["attention_mask"],
                "labels": label_ids}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_manifest", required=True)
    ap.add_argument("--dev_manifest", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--base_model", default="facebook/wav2vec2-large-xlsr-53")
    ap.add_argument("--output_dir", default="runs/w2v2_ctc")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup_steps", type=int, default=500)
    ap.add_argument("--freeze_feature_encoder", action="store_true", default=True)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                                 do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.base_model,
        ctc_loss_reduction="mean",
        pad_token_id=tokenizer.pad_token_id,
        vocab_size=len(tokenizer),
        layerdrop=0.0,
        mask_time_prob=0.05,
    )
    if args.freeze_feature_encoder:
        model.freeze_feature_encoder()

    train_ds, dev_ds = ManifestDataset(args.train_manifest), ManifestDataset(args.dev_manifest)
    collator = CTCCollator(processor)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                              num_workers=6)
    dev_loader = DataLoader(dev_ds, batch_size=args.batch_size, collate_fn=collator, num_workers=6)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps * accelerator.num_processes,
                                                total_steps)
    model, optimizer, train_loader, dev_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, dev_loader, scheduler
    )
    wer_metric = evaluate.load("wer")

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        processor.save_pretrained(args.output_dir)

    best_wer = float("inf")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if not torch.isfinite(loss):
                    logger.warning(f"non-finite CTC loss at step {step}, skipping batch", main_process_only=False)
                    optimizer.zero_grad()
                    continue
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 50 == 0:
                    mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
                    logger.info(f"epoch {epoch} step {step} loss {mean_loss.item():.3f} "
                                f"lr {scheduler.get_last_lr()[0]:.2e}")

        model.eval()
        for batch in dev_loader:
            with torch.no_grad():
                logits = model(input_values=batch["input_values"], attention_mask=batch["attention_mask"]).logits
            pred_ids = logits.argmax(dim=-1)
            pred_ids = accelerator.pad_across_processes(pred_ids, dim=1, pad_index=tokenizer.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            pred_ids, labels = accelerator.gather_for_metrics((pred_ids, labels))
            labels = labels.masked_fill(labels == -100, tokenizer.pad_token_id)
            preds = processor.batch_decode(pred_ids.cpu())
            refs = processor.batch_decode(labels.cpu(), group_tokens=False)
            wer_metric.add_batch(predictions=preds, references=refs)
        wer = wer_metric.compute()
        logger.info(f"epoch {epoch}: dev WER {wer:.4f}")

        accelerator.save_state(os.path.join(args.output_dir, "checkpoint_last"))
        if wer < best_wer:
            best_wer = wer
            accelerator.wait_for_everyone()
            accelerator.unwrap_model(model).save_pretrained(
                os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            )

    logger.info(f"best dev WER {best_wer:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
