"""QLoRA fine-tuning of LLaVA-1.5-7B on ScienceQA-IMG with Hugging Face Accelerate (DDP).

4-bit base model, one full copy per process; LoRA on the language model, projector trained.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        15_llava_qlora_accelerate_sqa.py --data-dir /data/scienceqa --out runs/llava_sqa_qlora
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import DataLoader
from transformers import (AutoProcessor, BitsAndBytesConfig, LlavaForConditionalGeneration,
                          get_linear_schedule_with_warmup)

LETTERS = "ABCDE"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llava-hf/llava-1.5-7b-hf")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_prompt(ex):
    ctx = f"Context: {ex['hint']}\n" if ex["hint"] else ""
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(ex["choices"]))
    return (f"USER: <image>\n{ctx}Question: {ex['question']}\nOptions:\n{opts}\n"
            f"Answer with the option's letter from the given choices directly. ASSISTANT:")


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb")
    set_seed(args.seed)
    accelerator.init_trackers("llava-sqa", config=vars(args))

    processor = AutoProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "left"
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    # whole model on this process's GPU: data parallel, not model parallel
    model = LlavaForConditionalGeneration.from_pretrained(
        args.model, quantization_config=bnb, torch_dtype=torch.bfloat16,
        device_map={"": accelerator.local_process_index})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM",
                      target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                      modules_to_save=["multi_modal_projector"])
    model = get_peft_model(model, lora)

    with accelerator.main_process_first():
        raw = load_dataset("derek-thomas/ScienceQA", cache_dir=os.path.join(args.data_dir, "hf_cache"))
        raw = raw.filter(lambda ex: ex["image"] is not None, num_proc=8)

    def train_collate(batch):
        prompts = [build_prompt(ex) for ex in batch]
        full = [p + " " + LETTERS[ex["answer"]] + processor.tokenizer.eos_token for p, ex in zip(prompts, batch)]
        images = [ex["image"].convert("RGB") for ex in batch]
        enc = processor(text=full, images=images, padding=True, return_tensors="pt")
        labels = torch.full_like(enc["input_ids"], -100)
        # answer letter + eos are the last two non-pad tokens (left padding)
        labels[:, -2:] = enc["input_ids"][:, -2:]
        enc["labels"] = labels
        return enc

    def eval_collate(batch):
        enc = processor(text=[build_prompt(ex) for ex in batch],
                        images=[ex["image"].convert("RGB") for ex in batch], padding=True, return_tensors="pt")
        enc["answer"] = torch.tensor([ex["answer"] for ex in batch])
        return enc

    train_loader = DataLoader(raw["train"], batch_size=args.batch_size, shuffle=True, collate_fn=train_collate,
                              num_workers=4, drop_last=True)
    val_loader = DataLoader(raw["validation"], batch_size=8, shuffle=False, collate_fn=eval_collate, num_workers=4)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / args.grad_accum)
    sched = get_linear_schedule_with_warmup(opt, int(0.03 * steps_per_epoch * args.epochs),
                                            steps_per_epoch * args.epochs)
    # prepare() shards both loaders across processes and wraps the model in DDP
    model, opt, train_loader, val_loader, sched = accelerator.prepare(model, opt, train_loader, val_loader, sched)

    letter_ids = torch.tensor([processor.tokenizer.convert_tokens_to_ids(c) for c in LETTERS],
                              device=accelerator.device)
    best = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 10 == 0:
                    avg = accelerator.reduce(loss.detach(), reduction="mean")
                    accelerator.log({"train/loss": avg.item(), "lr": sched.get_last_lr()[0]}, step=global_step)

        model.eval()
        correct = []
        with torch.no_grad():
            for batch in val_loader:
                answer = batch.pop("answer")
                logits = model(**batch).logits[:, -1]                 # next token after "ASSISTANT:"
                pred = logits[:, letter_ids].argmax(-1)
                correct.append(accelerator.gather_for_metrics((pred == answer).float()))
        acc = torch.cat(correct).mean().item()
        accelerator.log({"val/acc": acc, "epoch": epoch}, step=global_step)
        accelerator.print(f"epoch {epoch}: val acc {acc:.4f}")

        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.out, f"state_epoch{epoch}"))
        if acc > best:
            best = acc
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.out, "best_adapter"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.out, "best_adapter"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
