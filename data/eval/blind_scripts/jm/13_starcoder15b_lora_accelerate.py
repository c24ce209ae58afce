"""LoRA fine-tune of StarCoder (15.5B) for code completion on our monorepo, bf16, 🤗 Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        13_starcoder15b_lora_accelerate.py --data_path data/monorepo_py
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_from_disk
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--base_model", default="bigcode/starcoder")
    p.add_argument("--data_path", required=True, help="tokenized + packed dataset saved with save_to_disk")
    p.add_argument("--output_dir", default="lora/starcoder-monorepo")
    p.add_argument("--seq_length", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def collate(batch):
    ids = torch.stack([torch.as_tensor(b["input_ids"]) for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


def evaluate(model, loader, accelerator):
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
    model.train()
    loss = torch.cat(losses).mean().item()
    return loss, math.exp(min(loss, 20))


def main():
    args = parse()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    data = load_from_disk(args.data_path)
    train_dl = DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                          num_workers=2, drop_last=True)
    eval_dl = DataLoader(data["test"], batch_size=args.batch_size, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(
        args.base_model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        use_cache=False,
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["c_attn", "c_proj", "c_fc"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    step = 0
    pbar = tqdm(total=args.max_steps, disable=not accelerator.is_local_main_process)
    model.train()
    done = False
    while not done:
        for batch in train_dl:
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
            step += 1
            pbar.update(1)
            if step % 10 == 0:
                avg = accelerator.gather(loss.detach().reshape(1)).mean().item()
                pbar.set_postfix(loss=f"{avg:.4f}")
            if step % args.eval_every == 0:
                eval_loss, ppl = evaluate(model, eval_dl, accelerator)
                accelerator.print(f"step {step}: eval_loss {eval_loss:.4f} ppl {ppl:.2f}")
            if step % args.save_every == 0:
                accelerator.wait_for_everyone()
                unwrapped = accelerator.unwrap_model(model)
                unwrapped.save_pretrained(os.path.join(args.output_dir, f"step-{step}"),
                                          is_main_process=accelerator.is_main_process,
                                          save_function=accelerator.save)
            if step >= args.max_steps:
                done = True
                break

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
