# QLoRA instruction tuning for Mistral-7B on databricks-dolly-15k.
# Multi-GPU data parallel run:
#   torchrun --nproc_per_node 4 05_qlora_mistral_trainer.py --output_dir out/mistral-dolly-qlora
import argparse
import os

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
)


def get_args():
    parser = argparse.ArgumentParser(description="QLoRA SFT")
    parser.add_argument("--model_id", default="mistralai/Mistral-7B-Instruct-v0.2")
    parser.add_argument("--dataset", default="databricks/databricks-dolly-15k")
    parser.add_argument("--output_dir", default="out/mistral-dolly-qlora")
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--per_device_batch_size", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lora_r", type=int, default=64)
    parser.add_argument("--lora_alpha", type=int, default=16)
    parser.add_argument("--lora_dropout", type=float, default=0.1)
    parser.add_argument("--test_size", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--report_to", default="wandb")
    return parser.parse_args()


def format_dolly(sample):
    context = f"\n\nContext:\n{sample['context']}" if sample["context"] else ""
    return [
        {"role": "user", "content": f"{sample['instruction']}{context}"},
        {"role": "assistant", "content": sample["response"]},
    ]


def build_tokenize_fn(tokenizer, max_len):
    def tokenize(sample):
        msgs = format_dolly(sample)
        prompt_ids = tokenizer.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True)
        full_ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        full_ids = full_ids[:max_len]
        labels = [-100] * min(len(prompt_ids), len(full_ids)) + full_ids[len(prompt_ids):]
        return {"input_ids": full_ids, "attention_mask": [1] * len(full_ids), "labels": labels}

    return tokenize


def main():
    args = get_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model_id)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        optim="paged_adamw_32bit",
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_ratio=0.03,
        max_grad_norm=0.3,
        bf16=True,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=200,
        save_strategy="steps",
        save_steps=200,
        save_total_limit=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        ddp_find_unused_parameters=False,
        group_by_length=True,
        report_to=args.report_to,
        run_name=os.path.basename(args.output_dir),
        seed=args.seed,
    )

    ds = load_dataset(args.dataset, split="train")
    ds = ds.train_test_split(test_size=args.test_size, seed=args.seed)
    tok_fn = build_tokenize_fn(tokenizer, args.max_seq_len)
    with training_args.main_process_first(desc="tokenize"):
        train_ds = ds["train"].map(tok_fn, remove_columns=ds["train"].column_names)
        eval_ds = ds["test"].map(tok_fn, remove_columns=ds["test"].column_names)

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_id,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map="auto",
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )

    peft_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, peft_config)
    if int(os.environ.get("RANK", 0)) == 0:
        model.print_trainable_parameters()

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=8, label_pad_token_id=-100),
    )
    trainer.train()

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    # adapter only; merge later with merge_lora.py
    trainer.save_model(os.path.join(args.output_dir, "final_adapter"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final_adapter"))

    # a few generations from the held-out split for a quick sanity check
    if trainer.is_world_process_zero():
        model.eval()
        model.config.use_cache = True
        for sample in ds["test"].select(range(5)):
            msgs = format_dolly(sample)[:1]
            input_ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      return_tensors="pt").to(model.device)
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, max_new_tokens=200, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            print("=" * 80)
            print("PROMPT:", msgs[0]["content"][:500])
            print("OUTPUT:", tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
            print("REFERENCE:", sample["response"][:500])


if __name__ == "__main__":
    main()
