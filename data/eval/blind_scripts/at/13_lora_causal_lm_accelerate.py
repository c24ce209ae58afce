"""
LoRA adaptation of a small causal LM (TinyLlama-1.1B) to a domain corpus with
🤗 Accelerate. Reports held-out perplexity after every epoch and keeps the best
adapter. Mixed precision / number of processes come from `accelerate config`.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        lora_clm.py --dataset_name wikitext --dataset_config wikitext-103-raw-v1 \
        --output_dir /shared/lora/tinyllama_wt103
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model
from torch.utils.data import DataLoader
from transformers import (AutoModelForCausalLM, AutoTokenizer, default_data_collator,
                          get_scheduler)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    p.add_argument("--dataset_name", required=True)
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--num_epochs", type=int, default=2)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--lora_r", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--with_tracking", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="wandb" if args.with_tracking else None)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    raw = load_dataset(args.dataset_name, args.dataset_config)

    def tokenize(batch):
        return tokenizer(batch["text"])

    def group_texts(examples):
        concat = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concat["input_ids"]) // args.block_size) * args.block_size
        result = {k: [t[i: i + args.block_size] for i in range(0, total, args.block_size)]
                  for k, t in concat.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=8, remove_columns=raw["train"].column_names,
                            desc="tokenizing")
        lm_data = tokenized.map(group_texts, batched=True, num_proc=8, desc=f"grouping into {args.block_size}")

    train_loader = DataLoader(lm_data["train"], shuffle=True, collate_fn=default_data_collator,
                              batch_size=args.per_device_batch_size)
    eval_loader = DataLoader(lm_data["validation"], collate_fn=default_data_collator,
                             batch_size=args.per_device_batch_size)

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.lora_r, lora_alpha=2 * args.lora_r,
                          lora_dropout=0.05,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, peft_cfg)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=0.0)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    # length of the *sharded* loader; the prepared scheduler steps once per process
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = args.num_epochs * updates_per_epoch
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer,
                                 num_warmup_steps=args.warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers("lora-clm", config=vars(args))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).print_trainable_parameters()

    best_ppl = float("inf")
    completed = 0
    for epoch in range(args.num_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_loader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed += 1
                if completed % 50 == 0:
                    accelerator.print(f"epoch {epoch} update {completed}/{max_steps} loss {loss.item():.4f}")

        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                out = model(**batch)
            bs = batch["input_ids"].shape[0]
            losses.append(accelerator.gather_for_metrics(out.loss.repeat(bs)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses).item()
        ppl = math.exp(eval_loss) if eval_loss < 20 else float("inf")
        train_loss = accelerator.reduce(total_loss, reduction="mean").item() / len(train_loader)
        accelerator.print(f"epoch {epoch}: train_loss {train_loss:.4f} eval_loss {eval_loss:.4f} ppl {ppl:.2f}")
        if args.with_tracking:
            accelerator.log({"train_loss": train_loss, "eval_loss": eval_loss, "perplexity": ppl, "epoch": epoch},
                            step=completed)

        if ppl < best_ppl:
            best_ppl = ppl
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "last"),
                                                    is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
