#!/usr/bin/env python
# coding=utf-8
"""
Instruction tuning with the HF Trainer + DeepSpeed ZeRO-2 (optimizer offloaded to CPU).

    deepspeed --num_gpus 4 07_hf_trainer_ds_offload.py \
        --model_name_or_path Qwen/Qwen2-7B --data_path data/instruct.json \
        --output_dir out/qwen2-7b-sft --bf16 True --per_device_train_batch_size 2 \
        --gradient_accumulation_steps 8 --num_train_epochs 3 --learning_rate 1e-5 \
        --gradient_checkpointing True --report_to wandb
"""
import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import transformers
from torch.utils.data import Dataset
from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100

# Every value that also exists in TrainingArguments is "auto" so the Trainer fills it in
# from the command line and the two can never disagree.
DS_ZERO2_OFFLOAD = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}

PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="Qwen/Qwen2-7B")
    attn_implementation: Optional[str] = field(default="sdpa")


@dataclass
class DataArguments:
    data_path: str = field(default=None, metadata={"help": "Path to the training data (json list)."})
    model_max_length: int = field(default=2048)


@dataclass
class SFTTrainingArguments(TrainingArguments):
    optim: str = field(default="adamw_torch")
    lr_scheduler_type: str = field(default="linear")
    warmup_ratio: float = field(default=0.03)
    logging_steps: int = field(default=10)
    save_strategy: str = field(default="steps")
    save_steps: int = field(default=500)
    save_total_limit: int = field(default=3)
    gradient_checkpointing_kwargs: Optional[dict] = field(default_factory=lambda: {"use_reentrant": False})


class SupervisedDataset(Dataset):
    def __init__(self, path: str, tokenizer, max_len: int):
        with open(path) as f:
            records = json.load(f)
        self.examples = []
        for r in records:
            prompt = PROMPT.format(instruction=r["instruction"] + ("\n" + r["input"] if r.get("input") else ""))
            full = prompt + r["output"] + tokenizer.eos_token
            p_ids = tokenizer(prompt, truncation=True, max_length=max_len)["input_ids"]
            f_ids = tokenizer(full, truncation=True, max_length=max_len)["input_ids"]
            labels = copy.deepcopy(f_ids)
            labels[: len(p_ids)] = [IGNORE_INDEX] * min(len(p_ids), len(labels))
            self.examples.append((torch.tensor(f_ids), torch.tensor(labels)))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i) -> Dict[str, torch.Tensor]:
        ids, labels = self.examples[i]
        return {"input_ids": ids, "labels": labels}


@dataclass
class PadCollator:
    pad_id: int

    def __call__(self, features: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence([f["input_ids"] for f in features], batch_first=True,
                                              padding_value=self.pad_id)
        labels = torch.nn.utils.rnn.pad_sequence([f["labels"] for f in features], batch_first=True,
                                                 padding_value=IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(self.pad_id)}


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, SFTTrainingArguments))
    # --deepspeed on the command line still wins over the built-in config
    parser.set_defaults(deepspeed=DS_ZERO2_OFFLOAD)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO if training_args.should_log else logging.WARN,
    )
    set_seed(training_args.seed)

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, model_max_length=data_args.model_max_length,
        padding_side="right", use_fast=True,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        torch_dtype=torch.bfloat16 if training_args.bf16 else None,
        attn_implementation=model_args.attn_implementation,
    )
    if training_args.gradient_checkpointing:
        model.config.use_cache = False

    # main process first, so the tokenizer / data files are fetched once and not by every rank at once
    with training_args.main_process_first(desc="tokenising dataset"):
        train_dataset = SupervisedDataset(data_args.data_path, tokenizer, data_args.model_max_length)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=PadCollator(tokenizer.pad_token_id),
        tokenizer=tokenizer,
    )
    trainer.train(resume_from_checkpoint=None)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)
        logger.info("model written to %s", training_args.output_dir)


if __name__ == "__main__":
    main()
