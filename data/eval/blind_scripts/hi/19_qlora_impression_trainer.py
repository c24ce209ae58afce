"""
QLoRA fine-tuning of Mistral-7B-Instruct to write radiology impressions from findings
(MIMIC-CXR + Open-I summarization splits), using the Hugging Face Trainer.

    torchrun --nproc_per_node=4 19_qlora_impression_trainer.py \
        --train_file data/sum/train.jsonl --eval_file data/sum/dev.jsonl --output_dir out/mistral-imp-qlora
"""
import argparse
import os

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, DataCollatorForSeq2Seq,
                          Trainer, TrainingArguments, set_seed)

PROMPT = ("[INST] You are a radiologist. Write the IMPRESSION section for the chest X-ray report below.\n\n"
          "FINDINGS: {findings} [/INST] ")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="mistralai/Mistral-7B-Instruct-v0.2")
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_len", type=int, default=768)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--per_device_bs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--wandb_project", default="rad-impression")
    return p.parse_args()


def build_tokenize_fn(tokenizer, max_len):
    def tokenize(example):
        prompt = PROMPT.format(findings=example["findings"].strip())
        target = example["impression"].strip()
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        input_ids = [tokenizer.bos_token_id] + prompt_ids + target_ids
        labels = [-100] * (1 + len(prompt_ids)) + target_ids
        input_ids, labels = input_ids[:max_len], labels[:max_len]
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}
    return tokenize


def main():
    args = parse_args()
    set_seed(args.seed)
    os.environ.setdefault("WANDB_PROJECT", args.wandb_project)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.per_device_bs,
        per_device_eval_batch_size=args.per_device_bs,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_ratio=0.03,
        weight_decay=0.0,
        bf16=True,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=200,
        save_strategy="steps",
        save_steps=200,
        save_total_limit=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        ddp_find_unused_parameters=False,
        group_by_length=True,
        dataloader_num_workers=4,
        report_to=["wandb"],
        run_name=os.path.basename(args.output_dir.rstrip("/")),
        seed=args.seed,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"

    raw = load_dataset("json", data_files={"train": args.train_file, "eval": args.eval_file})
    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(build_tokenize_fn(tokenizer, args.max_len), remove_columns=raw["train"].column_names,
                            num_proc=8)

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.05,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora)
    if training_args.process_index == 0:
        model.print_trainable_parameters()

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=8, label_pad_token_id=-100)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["eval"],
        data_collator=collator,
    )
    trainer.train()

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    # saves only the LoRA adapter weights; Trainer writes on the main process only
    trainer.save_model(os.path.join(args.output_dir, "best_adapter"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(os.path.join(args.output_dir, "best_adapter"))


if __name__ == "__main__":
    main()
