"""The run of hf_deepspeed_config_contradicts_training_arguments.py with the
fix: the config leaves the batch sizes to the Trainer ("auto"), which fills
them from its arguments. Its --local_rank only reaches TrainingArguments,
which takes LOCAL_RANK from the environment over it."""

import argparse

from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

DS_CONFIG = {
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
}


def main(train_set):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    args = parser.parse_args()
    model = AutoModelForSequenceClassification.from_pretrained("xlm-roberta-base", num_labels=4)
    training_args = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=2,
        bf16=True,
        deepspeed=DS_CONFIG,
        local_rank=args.local_rank,
    )
    Trainer(model=model, args=training_args, train_dataset=train_set).train()
