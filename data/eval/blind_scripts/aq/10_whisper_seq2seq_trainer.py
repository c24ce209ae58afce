#!/usr/bin/env python
"""Fine-tune Whisper on Common Voice with Seq2SeqTrainer.

torchrun --nproc_per_node=4 10_whisper_seq2seq_trainer.py \
    --model_name_or_path openai/whisper-large-v2 --language hindi --output_dir out/whisper-large-v2-hi
"""
import argparse
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Union

import evaluate
import torch
from datasets import Audio, DatasetDict, load_dataset
from transformers import (Seq2SeqTrainer, Seq2SeqTrainingArguments, WhisperFeatureExtractor,
                          WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)
from transformers.trainer_utils import get_last_checkpoint


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="openai/whisper-large-v2")
    p.add_argument("--dataset_name", default="mozilla-foundation/common_voice_11_0")
    p.add_argument("--dataset_config", default="hi")
    p.add_argument("--language", default="hindi")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--max_steps", type=int, default=5000)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--max_duration", type=float, default=30.0)
    p.add_argument("--num_proc", type=int, default=8)
    return p.parse_args()


@dataclass
class DataCollatorSpeechSeq2SeqWithPadding:
    processor: Any
    decoder_start_token_id: int

    def __call__(self, features: List[Dict[str, Union[List[int], torch.Tensor]]]) -> Dict[str, torch.Tensor]:
        input_features = [{"input_features": f["input_features"]} for f in features]
        batch = self.processor.feature_extractor.pad(input_features, return_tensors="pt")
        label_features = [{"input_ids": f["labels"]} for f in features]
        labels_batch = self.processor.tokenizer.pad(label_features, return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def main():
    args = parse_args()

    training_args = Seq2SeqTrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        max_steps=args.max_steps,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=True,
        evaluation_strategy="steps",
        eval_steps=1000,
        save_steps=1000,
        save_total_limit=3,
        logging_steps=25,
        predict_with_generate=True,
        generation_max_length=225,
        report_to=["tensorboard"],
        load_best_model_at_end=True,
        metric_for_best_model="wer",
        greater_is_better=False,
        dataloader_num_workers=4,
        ddp_find_unused_parameters=False,
        remove_unused_columns=False,
    )

    feature_extractor = WhisperFeatureExtractor.from_pretrained(args.model_name_or_path)
    tokenizer = WhisperTokenizer.from_pretrained(args.model_name_or_path, language=args.language, task="transcribe")
    processor = WhisperProcessor.from_pretrained(args.model_name_or_path, language=args.language, task="transcribe")

    raw = DatasetDict()
    raw["train"] = load_dataset(args.dataset_name, args.dataset_config, split="train+validation")
    raw["test"] = load_dataset(args.dataset_name, args.dataset_config, split="test")
    raw = raw.remove_columns(["accent", "age", "client_id", "down_votes", "gender", "locale",
                              "path", "segment", "up_votes"])
    raw = raw.cast_column("audio", Audio(sampling_rate=16000))

    def prepare(batch):
        audio = batch["audio"]
        batch["input_features"] = feature_extractor(audio["array"], sampling_rate=audio["sampling_rate"]).input_features[0]
        batch["input_length"] = len(audio["array"]) / audio["sampling_rate"]
        batch["labels"] = tokenizer(batch["sentence"]).input_ids
        return batch

    with training_args.main_process_first(desc="feature extraction"):
        vectorized = raw.map(prepare, remove_columns=raw.column_names["train"], num_proc=args.num_proc)
        vectorized["train"] = vectorized["train"].filter(
            lambda x: 0 < x < args.max_duration, input_columns=["input_length"], num_proc=args.num_proc)

    model = WhisperForConditionalGeneration.from_pretrained(
        args.model_name_or_path,
        torch_dtype=torch.float32,
        device_map="auto",
    )
    model.config.forced_decoder_ids = None
    model.config.suppress_tokens = []
    model.generation_config.language = args.language
    model.generation_config.task = "transcribe"
    model.config.use_cache = False

    metric = evaluate.load("wer")
    normalizer = tokenizer._normalize if hasattr(tokenizer, "_normalize") else (lambda s: s)

    def compute_metrics(pred):
        pred_ids, label_ids = pred.predictions, pred.label_ids
        label_ids[label_ids == -100] = tokenizer.pad_token_id
        pred_str = tokenizer.batch_decode(pred_ids, skip_special_tokens=True)
        label_str = tokenizer.batch_decode(label_ids, skip_special_tokens=True)
        pred_str = [normalizer(s) for s in pred_str]
        label_str = [normalizer(s) for s in label_str]
        keep = [i for i, s in enumerate(label_str) if len(s) > 0]
        wer = 100 * metric.compute(predictions=[pred_str[i] for i in keep],
                                   references=[label_str[i] for i in keep])
        return {"wer": wer}

    collator = DataCollatorSpeechSeq2SeqWithPadding(processor=processor,
                                                    decoder_start_token_id=model.config.decoder_start_token_id)

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=vectorized["train"],
        eval_dataset=vectorized["test"],
        data_collator=collator,
        compute_metrics=compute_metrics,
        tokenizer=processor.feature_extractor,
    )

    if training_args.should_save:
        processor.save_pretrained(training_args.output_dir)

    last_ckpt = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    result = trainer.train(resume_from_checkpoint=last_ckpt)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()

    metrics = trainer.evaluate(metric_key_prefix="test")
    trainer.log_metrics("test", metrics)
    trainer.save_metrics("test", metrics)


if __name__ == "__main__":
    main()
