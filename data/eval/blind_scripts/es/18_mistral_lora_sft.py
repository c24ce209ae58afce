"""LoRA fine-tuning of Mistral-7B on support-chat transcripts (chat template), bf16.

Started from the single-GPU notebook; this is the multi-GPU version.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 18_mistral_lora_sft.py \
        --data data/support_chats.jsonl --out runs/mistral_lora
"""
import argparse
import math
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mistralai/Mistral-7B-v0.3")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"

    def encode(example):
        msgs = example["messages"]
        prompt_ids = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
        full_ids = tokenizer.apply_chat_template(msgs, tokenize=True)[: args.max_len]
        labels = [-100] * min(len(prompt_ids), len(full_ids)) + full_ids[len(prompt_ids):]
        return {"input_ids": full_ids, "attention_mask": [1] * len(full_ids), "labels": labels}

    raw = load_dataset("json", data_files=args.data, split="train")
    with accelerator.main_process_first():
        ds = raw.map(encode, remove_columns=raw.column_names, num_proc=8)
        ds = ds.filter(lambda e: any(l != -100 for l in e["labels"]), num_proc=8)
        ds = ds.train_test_split(test_size=500, seed=args.seed)

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=16, label_pad_token_id=-100)
    train_loader = DataLoader(ds["train"], batch_size=args.micro_bs, shuffle=True, collate_fn=collator)
    eval_loader = DataLoader(ds["test"], batch_size=args.micro_bs, collate_fn=collator)

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora_cfg = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora_cfg)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    def run_eval():
        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].size(0))))
        model.train()
        return torch.cat(losses).mean().item()

    step = 0
    model.train()
    for epoch in range(args.epochs):
        tic = time.time()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 10 == 0:
                    l = accelerator.reduce(loss.detach(), reduction="mean").item()
                    accelerator.print(f"ep {epoch} step {step} loss {l:.4f} "
                                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - tic) / 10:.1f}s/step")
                    tic = time.time()
                if step % args.eval_every == 0:
                    eval_loss = run_eval()
                    accelerator.print(f"step {step}: eval loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}")
                    accelerator.save_state(os.path.join(args.out, f"state_{step}"))

    eval_loss = run_eval()
    accelerator.print(f"final eval loss {eval_loss:.4f}")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.out, "adapter"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.out, "adapter"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
