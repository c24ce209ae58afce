# -*- coding: utf-8 -*-
"""
ChatGLM2-6B + LoRA 指令微调：客服工单意图分类（生成式，输出意图名称）

数据格式 (jsonl):
    {"instruction": "判断下面这条用户反馈属于哪个意图", "input": "快递三天了还没到", "output": "物流查询"}

启动（单机 4 卡）:
    torchrun --nproc_per_node=4 04_chatglm_lora_sft.py \
        --model_path /models/chatglm2-6b --train_file data/intent_sft/train.jsonl \
        --eval_file data/intent_sft/dev.jsonl --output_dir output/chatglm2_intent_lora
"""
import argparse
import json
import logging
import os

import torch
from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model
from transformers import (
    AutoModel,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)

PROMPT_TEMPLATE = "[Round 1]\n\n问：{instruction}\n{input}\n\n答："


def parse_args():
    parser = argparse.ArgumentParser(description="ChatGLM2 LoRA SFT")
    parser.add_argument("--model_path", type=str, required=True)
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--eval_file", type=str, default=None)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--max_source_length", type=int, default=256)
    parser.add_argument("--max_target_length", type=int, default=32)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--num_train_epochs", type=float, default=3)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def build_preprocess_fn(tokenizer, max_source_length, max_target_length):
    def preprocess(examples):
        model_inputs = {"input_ids": [], "labels": []}
        for ins, inp, out in zip(examples["instruction"], examples["input"], examples["output"]):
            prompt = PROMPT_TEMPLATE.format(instruction=ins, input=inp)
            a_ids = tokenizer.encode(text=prompt, add_special_tokens=True, truncation=True,
                                     max_length=max_source_length)
            b_ids = tokenizer.encode(text=out, add_special_tokens=False, truncation=True,
                                     max_length=max_target_length)
            input_ids = a_ids + b_ids + [tokenizer.eos_token_id]
            # prompt 部分不计算 loss
            labels = [-100] * len(a_ids) + b_ids + [tokenizer.eos_token_id]
            model_inputs["input_ids"].append(input_ids)
            model_inputs["labels"].append(labels)
        return model_inputs

    return preprocess


def print_trainable_parameters(model):
    trainable, total = 0, 0
    for _, p in model.named_parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    logger.info("可训练参数: %d / %d (%.4f%%)", trainable, total, 100 * trainable / total)


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    set_seed(args.seed)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        num_train_epochs=args.num_train_epochs,
        lr_scheduler_type="cosine",
        warmup_ratio=0.03,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=3,
        evaluation_strategy="steps" if args.eval_file else "no",
        eval_steps=args.save_steps,
        fp16=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        report_to="tensorboard",
        seed=args.seed,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model_path, trust_remote_code=True)
    model = AutoModel.from_pretrained(
        args.model_path,
        trust_remote_code=True,
        torch_dtype=torch.float16,
        device_map="auto",
    )
    model.config.use_cache = False

    lora_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["query_key_value"],
        inference_mode=False,
    )
    model = get_peft_model(model, lora_config)
    # LoRA 参数用 fp32 训练，更稳定
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    print_trainable_parameters(model)

    data_files = {"train": args.train_file}
    if args.eval_file:
        data_files["validation"] = args.eval_file
    raw = load_dataset("json", data_files=data_files)
    preprocess = build_preprocess_fn(tokenizer, args.max_source_length, args.max_target_length)
    with training_args.main_process_first(desc="tokenize"):
        tokenized = raw.map(preprocess, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names, desc="分词")

    if training_args.local_rank in (-1, 0):
        sample = tokenized["train"][0]
        logger.info("样例 input: %s", tokenizer.decode(sample["input_ids"]))
        logger.info("样例 label 长度: %d", sum(1 for x in sample["labels"] if x != -100))

    collator = DataCollatorForSeq2Seq(tokenizer, model=None, label_pad_token_id=-100,
                                      pad_to_multiple_of=8, padding=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized.get("validation"),
        tokenizer=tokenizer,
        data_collator=collator,
    )
    train_result = trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()

    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "final", "train_args.json"), "w", encoding="utf-8") as f:
            json.dump(vars(args), f, ensure_ascii=False, indent=2)
        logger.info("训练完成，LoRA 权重保存在 %s", os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()
