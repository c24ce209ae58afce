#!/usr/bin/env python
# QLoRA fine-tuning of llava-hf/llava-1.5-7b-hf on our in-house chart/document QA set.
# 4-bit NF4 LLM, LoRA on the language model's linear layers, projector trained in full,
# vision tower frozen.
#
#   accelerate launch --num_processes 4 --mixed_precision bf16 05_qlora_llava_hf_accelerate.py \
#       --train_file data/docqa_train.jsonl --eval_file data/docqa_val.jsonl
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import (AutoProcessor, BitsAndBytesConfig, LlavaForConditionalGeneration,
                          get_linear_schedule_with_warmup)

MODEL_ID = "llava-hf/llava-1.5-7b-hf"
PROMPT = "USER: <image>\n{question} ASSISTANT:"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--image_dir", default="data/images")
    p.add_argument("--output_dir", default="outputs/llava-docqa-qlora")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class DocQADataset(Dataset):
    def __init__(self, path, image_dir):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"image": Image.open(os.path.join(self.image_dir, r["image"])).convert("RGB"),
                "question": r["question"], "answer": r["answer"]}


class TrainCollator:
    def __init__(self, processor, max_length):
        self.processor = processor
        self.max_length = max_length

    def __call__(self, examples):
        prompts = [PROMPT.format(question=e["question"]) for e in examples]
        texts = [p + " " + e["answer"] + self.processor.tokenizer.eos_token for p, e in zip(prompts, examples)]
        batch = self.processor(text=texts, images=[e["image"] for e in examples], padding=True,
                               truncation=True, max_length=self.max_length, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        for i, p in enumerate(prompts):
            n_prompt = len(self.processor(text=p, images=examples[i]["image"])["input_ids"][0])
            labels[i, :n_prompt] = -100
        batch["labels"] = labels
        return batch


def main():
    args = parse()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)

    processor = AutoProcessor.from_pretrained(MODEL_ID)
    processor.tokenizer.padding_side = "right"
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True,
                             llm_int8_skip_modules=["vision_tower", "multi_modal_projector"])
    model = LlavaForConditionalGeneration.from_pretrained(
        MODEL_ID, quantization_config=bnb, torch_dtype=torch.bfloat16, device_map="auto"
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05, bias="none",
                      target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                      modules_to_save=["multi_modal_projector"])
    model = get_peft_model(model, lora)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    train_ds = DocQADataset(args.train_file, args.image_dir)
    eval_ds = DocQADataset(args.eval_file, args.image_dir)
    collator = TrainCollator(processor, args.max_length)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                              num_workers=4)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, collate_fn=collator, num_workers=4)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total_steps), total_steps)
    scheduler = accelerator.prepare(scheduler)

    accelerator.init_trackers("llava-docqa", config=vars(args))
    progress = tqdm(total=total_steps, disable=not accelerator.is_local_main_process)
    global_step = 0
    best_eval = float("inf")
    for epoch in range(args.epochs):
        model.train()
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
                global_step += 1
                progress.update(1)
                if global_step % 10 == 0:
                    avg = accelerator.gather(loss.detach()).mean().item()
                    accelerator.log({"train_loss": avg, "lr": scheduler.get_last_lr()[0]}, step=global_step)

        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.detach().repeat(batch["input_ids"].size(0))))
        eval_loss = torch.cat(losses).mean().item()
        accelerator.log({"eval_loss": eval_loss, "epoch": epoch}, step=global_step)
        accelerator.print(f"epoch {epoch}: eval_loss={eval_loss:.4f}")

        if eval_loss < best_eval:
            best_eval = eval_loss
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
