# -*- coding: utf-8 -*-
"""
ChatGLM3-6B LoRA 微调 —— 电商商品标题 -> 类目路径 生成（"服饰鞋包/女装/连衣裙"）
HF Trainer + DeepSpeed ZeRO-2，bf16

启动:
    deepspeed --num_gpus=8 12_chatglm_trainer_ds.py \
        --model_name_or_path /models/chatglm3-6b \
        --train_file data/cate/train.jsonl --validation_file data/cate/dev.jsonl \
        --output_dir output/chatglm3_cate_lora --per_device_train_batch_size 8 --gradient_accumulation_steps 2
"""
import argparse
import json
import logging
import os
import sys

import torch
from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model
from transformers import (
    AutoModel,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)

# ZeRO-2 配置，batch / lr / 精度都写 auto，由 TrainingArguments 统一填充，避免两边不一致
DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                   "warmup_num_steps": "auto", "total_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--train_file", type=str, required=True, help="jsonl: {title, category}")
    parser.add_argument("--validation_file", type=str, default=None)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--max_target_length", type=int, default=48)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--num_train_epochs", type=float, default=2)
    parser.add_argument("--save_steps", type=int, default=1000)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--preprocessing_num_workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    # deepspeed 启动器会传 --local_rank，这里接住即可，TrainingArguments 自己从环境变量读
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


class SaveAdapterCallback(TrainerCallback):
    """每次保存 checkpoint 时额外导出一份只有 LoRA 的权重，方便线上合并"""

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            path = os.path.join(args.output_dir, f"adapter-{state.global_step}")
            model.save_pretrained(path)
            logger.info("LoRA adapter 导出到 %s", path)
        return control


def build_prompt(title):
    return f"请给出下面商品标题所属的三级类目。\n商品标题：{title}"


def main():
    args = parse_args()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        num_train_epochs=args.num_train_epochs,
        warmup_ratio=0.03,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=20,
        save_steps=args.save_steps,
        save_total_limit=2,
        evaluation_strategy="steps" if args.validation_file else "no",
        eval_steps=args.save_steps,
        bf16=True,
        deepspeed=DS_CONFIG,
        remove_unused_columns=False,
        report_to=["tensorboard"],
        seed=args.seed,
    )

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARN)
    logger.warning("rank %d / world %d, device %s", training_args.process_index,
                   training_args.world_size, training_args.device)
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=True)
    model = AutoModel.from_pretrained(args.model_name_or_path, trust_remote_code=True,
                                      torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    peft_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["query_key_value", "dense_h_to_4h", "dense_4h_to_h"],
    )
    model = get_peft_model(model, peft_config)
    if training_args.should_log:
        model.print_trainable_parameters()

    def preprocess(examples):
        out = {"input_ids": [], "labels": []}
        for title, cate in zip(examples["title"], examples["category"]):
            prompt_ids = tokenizer.build_chat_input(build_prompt(title), history=[], role="user")["input_ids"][0].tolist()
            prompt_ids = prompt_ids[: args.max_source_length]
            target_ids = tokenizer.encode(cate, add_special_tokens=False)[: args.max_target_length]
            input_ids = prompt_ids + target_ids + [tokenizer.eos_token_id]
            labels = [-100] * len(prompt_ids) + target_ids + [tokenizer.eos_token_id]
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
        return out

    data_files = {"train": args.train_file}
    if args.validation_file:
        data_files["validation"] = args.validation_file
    raw = load_dataset("json", data_files=data_files)
    # 主进程先处理并写 datasets 缓存，其它进程随后直接命中缓存
    with training_args.main_process_first(desc="数据预处理"):
        tokenized = raw.map(preprocess, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, load_from_cache_file=True)

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"] if "validation" in tokenized else None,
        data_collator=collator,
        tokenizer=tokenizer,
        callbacks=[SaveAdapterCallback()],
    )

    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # save_model 要所有 rank 一起调用（deepspeed 下内部会做收集），写盘只在主进程
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()

    if "validation" in tokenized:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "ds_config_used.json"), "w", encoding="utf-8") as f:
            json.dump(DS_CONFIG, f, ensure_ascii=False, indent=2)


if __name__ == "__main__":
    main()
