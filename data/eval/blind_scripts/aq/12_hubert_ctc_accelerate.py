#!/usr/bin/env python
"""HuBERT-large CTC fine-tuning on LibriSpeech 100h with Accelerate.

accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 12_hubert_ctc_accelerate.py \
    --output_dir out/hubert-large-ls100 --vocab_file vocab.json
"""
import argparse
import math
import os
import re

import datasets
import evaluate
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (HubertForCTC, Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2Processor,
                          get_scheduler)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="facebook/hubert-large-ll60k")
    p.add_argument("--vocab_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--train_split", default="train.100")
    p.add_argument("--eval_split", default="validation")
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--num_train_epochs", type=int, default=30)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--max_duration", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with_tracking", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=args.layerdrop > 0)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="tensorboard" if args.with_tracking else None,
                              project_dir=args.output_dir, kwargs_handlers=[ddp_kwargs])
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab_file, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                                 do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    max_len = int(args.max_duration * 16000)

    def prepare(batch):
        audio = batch["audio"]
        batch["input_values"] = feature_extractor(audio["array"], sampling_rate=16000).input_values[0]
        batch["length"] = len(batch["input_values"])
        batch["labels"] = tokenizer(re.sub(r"\s+", " ", batch["text"]).strip()).input_ids
        return batch

    with accelerator.main_process_first():
        raw = datasets.DatasetDict({
            "train": datasets.load_dataset("librispeech_asr", "clean", split=args.train_split),
            "eval": datasets.load_dataset("librispeech_asr", "clean", split=args.eval_split),
        })
        raw = raw.cast_column("audio", datasets.Audio(sampling_rate=16000))
        vectorized = raw.map(prepare, remove_columns=raw["train"].column_names, num_proc=8,
                             desc="preprocess")
        vectorized["train"] = vectorized["train"].filter(lambda n: n <= max_len, input_columns=["length"])

    def collate(features):
        batch = feature_extractor.pad([{"input_values": f["input_values"]} for f in features],
                                      padding=True, return_tensors="pt")
        labels = tokenizer.pad([{"input_ids": f["labels"]} for f in features], padding=True, return_tensors="pt")
        batch["labels"] = labels["input_ids"].masked_fill(labels.attention_mask.ne(1), -100)
        return batch

    train_loader = DataLoader(vectorized["train"], batch_size=args.per_device_batch_size, shuffle=True,
                              collate_fn=collate, num_workers=4, drop_last=True)
    eval_loader = DataLoader(vectorized["eval"], batch_size=args.per_device_batch_size, collate_fn=collate,
                             num_workers=2)

    model = HubertForCTC.from_pretrained(
        args.model_name_or_path, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, layerdrop=args.layerdrop,
        mask_time_prob=0.065, mask_time_length=10, mask_feature_prob=0.012, mask_feature_length=64,
        final_dropout=0.1, hidden_dropout=0.1, activation_dropout=0.0, attention_dropout=0.1)
    model.freeze_feature_encoder()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = steps_per_epoch * args.num_train_epochs
    # the prepared scheduler is stepped once per process on every sync step
    lr_scheduler = get_scheduler("linear", optimizer,
                                 num_warmup_steps=int(args.warmup_ratio * max_steps) * accelerator.num_processes,
                                 num_training_steps=max_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers("hubert_ctc", config=vars(args))

    wer_metric = evaluate.load("wer")
    progress = tqdm(range(max_steps), disable=not accelerator.is_local_main_process)
    completed = 0
    best_wer = math.inf
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                completed += 1
                progress.update(1)
                if completed % 50 == 0:
                    avg_loss = accelerator.gather(loss.detach()).mean().item()
                    progress.set_postfix(loss=f"{avg_loss:.3f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                    if args.with_tracking:
                        accelerator.log({"train_loss": avg_loss, "lr": lr_scheduler.get_last_lr()[0]}, step=completed)

        model.eval()
        for batch in eval_loader:
            with torch.no_grad():
                logits = model(**batch).logits
            pred_ids = accelerator.pad_across_processes(logits.argmax(-1), dim=1, pad_index=tokenizer.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            pred_ids, labels = accelerator.gather_for_metrics((pred_ids, labels))
            labels[labels == -100] = tokenizer.pad_token_id
            preds = processor.batch_decode(pred_ids.cpu().numpy())
            refs = processor.batch_decode(labels.cpu().numpy(), group_tokens=False)
            wer_metric.add_batch(predictions=preds, references=refs)
        wer = wer_metric.compute()
        logger.info(f"epoch {epoch}: eval WER {wer * 100:.2f}", main_process_only=True)
        if args.with_tracking:
            accelerator.log({"eval_wer": wer, "epoch": epoch}, step=completed)

        accelerator.save_state(os.path.join(args.output_dir, "last_state"))
        if wer < best_wer:
            best_wer = wer
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
