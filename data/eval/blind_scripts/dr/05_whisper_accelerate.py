"""Fine-tune Whisper (seq2seq, cross-entropy) with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 05_whisper_accelerate.py \
        --dataset_dir /data/hf/voxpopuli_en --output_dir exp/whisper_base_vp --model openai/whisper-base

The dataset directory is a DatasetDict (train / validation) with an "audio" column (16 kHz)
and a "normalized_text" column.
"""
import argparse
import math
import os

import evaluate
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import Audio, load_from_disk
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_linear_schedule_with_warmup
from transformers.models.whisper.english_normalizer import BasicTextNormalizer

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="openai/whisper-base")
    p.add_argument("--language", default="english")
    p.add_argument("--train_batch_size", type=int, default=32)
    p.add_argument("--eval_batch_size", type=int, default=32)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_duration", type=float, default=30.0)
    p.add_argument("--max_label_length", type=int, default=225)
    p.add_argument("--generation_max_length", type=int, default=225)
    p.add_argument("--eval_steps", type=int, default=2000)
    p.add_argument("--preprocessing_num_workers", type=int, default=16)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class SpeechSeq2SeqCollator:
    def __init__(self, processor, decoder_start_token_id):
        self.processor = processor
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, features):
        inputs = [{"input_features": f["input_features"]} for f in features]
        batch = self.processor.feature_extractor.pad(inputs, return_tensors="pt")
        labels = [{"input_ids": f["labels"]} for f in features]
        labels_batch = self.processor.tokenizer.pad(labels, return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, log_with="wandb")
    set_seed(args.seed)
    accelerator.init_trackers("whisper-finetune", config=vars(args))

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.generation_config.language = args.language
    model.generation_config.task = "transcribe"
    model.generation_config.forced_decoder_ids = None

    raw = load_from_disk(args.dataset_dir)
    raw = raw.cast_column("audio", Audio(sampling_rate=16000))

    def prepare(example):
        audio = example["audio"]
        example["input_features"] = processor.feature_extractor(
            audio["array"], sampling_rate=audio["sampling_rate"]
        ).input_features[0]
        example["input_length"] = len(audio["array"]) / audio["sampling_rate"]
        example["labels"] = processor.tokenizer(example["normalized_text"]).input_ids
        return example

    # rank 0 runs the map and writes the arrow cache, the other ranks then load it
    with accelerator.main_process_first():
        vectorized = raw.map(prepare, remove_columns=raw["train"].column_names,
                             num_proc=args.preprocessing_num_workers, desc="extract features")
        vectorized["train"] = vectorized["train"].filter(
            lambda d, lab: d < args.max_duration and len(lab) < args.max_label_length,
            input_columns=["input_length", "labels"], num_proc=args.preprocessing_num_workers,
        )
    vectorized = vectorized.remove_columns("input_length")

    collator = SpeechSeq2SeqCollator(processor, model.config.decoder_start_token_id)
    train_loader = DataLoader(vectorized["train"], batch_size=args.train_batch_size, shuffle=True,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(vectorized["validation"], batch_size=args.eval_batch_size,
                             collate_fn=collator, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_loader) / (accelerator.num_processes * args.gradient_accumulation_steps))
    max_steps = steps_per_epoch * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps * accelerator.num_processes,
                                                max_steps * accelerator.num_processes)

    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    global_step, start_epoch = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        global_step = int(os.path.basename(args.resume_from.rstrip("/")).split("-")[-1])
        start_epoch = global_step // steps_per_epoch

    wer_metric = evaluate.load("wer")
    normalizer = BasicTextNormalizer()

    def run_eval():
        model.eval()
        preds, refs = [], []
        pad_id = processor.tokenizer.pad_token_id
        for batch in tqdm(eval_loader, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                generated = accelerator.unwrap_model(model).generate(
                    input_features=batch["input_features"], max_new_tokens=args.generation_max_length,
                    language=args.language, task="transcribe",
                )
            generated = accelerator.pad_across_processes(generated, dim=1, pad_index=pad_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            generated, labels = accelerator.gather_for_metrics((generated, labels))
            labels = labels.masked_fill(labels == -100, pad_id)
            preds += processor.batch_decode(generated, skip_special_tokens=True)
            refs += processor.batch_decode(labels, skip_special_tokens=True)
        model.train()
        preds = [normalizer(p) for p in preds]
        refs = [normalizer(r) for r in refs]
        keep = [i for i, r in enumerate(refs) if r.strip()]
        return wer_metric.compute(predictions=[preds[i] for i in keep], references=[refs[i] for i in keep])

    progress = tqdm(total=max_steps, initial=global_step, disable=not accelerator.is_local_main_process)
    model.train()
    for epoch in range(start_epoch, args.num_train_epochs):
        loader = train_loader
        if args.resume_from and epoch == start_epoch:
            loader = accelerator.skip_first_batches(
                train_loader, (global_step % steps_per_epoch) * args.gradient_accumulation_steps
            )
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            progress.update(1)
            if global_step % 50 == 0:
                avg_loss = accelerator.gather(loss.detach()).mean().item()
                accelerator.log({"train/loss": avg_loss, "train/lr": scheduler.get_last_lr()[0]}, step=global_step)
            if global_step % args.eval_steps == 0:
                wer = run_eval()
                accelerator.log({"eval/wer": 100 * wer}, step=global_step)
                logger.info(f"step {global_step}: WER {100 * wer:.2f}")
                ckpt = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                accelerator.save_state(ckpt)
                accelerator.wait_for_everyone()
                unwrapped = accelerator.unwrap_model(model)
                unwrapped.save_pretrained(ckpt, is_main_process=accelerator.is_main_process,
                                          save_function=accelerator.save)
                if accelerator.is_main_process:
                    processor.save_pretrained(ckpt)

    accelerator.wait_for_everyone()
    wer = run_eval()
    accelerator.log({"eval/wer": 100 * wer}, step=global_step)
    logger.info(f"final WER {100 * wer:.2f}")
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        processor.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
