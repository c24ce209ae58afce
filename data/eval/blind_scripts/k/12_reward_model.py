"""Pairwise reward model (Bradley-Terry) on preference data for the RLHF pipeline.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 12_reward_model.py \
        --config configs/rm_llama3_8b.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger(__name__)


@dataclass
class RMConfig:
    base_model: str = "/models/llama-3-8b-sft"
    train_data: str = "/data/prefs/train.jsonl"
    eval_data: str = "/data/prefs/eval.jsonl"
    output_dir: str = "/ckpt/rm-llama3-8b"
    max_length: int = 1024
    per_device_batch_size: int = 2
    grad_accum: int = 8
    lr: float = 9e-6
    epochs: int = 1
    warmup_ratio: float = 0.03
    eval_every: int = 200
    seed: int = 42
    margin_loss: bool = False


class PairCollator:
    def __init__(self, tokenizer, max_length):
        self.tok, self.max_length = tokenizer, max_length

    def _render(self, prompt, response):
        return self.tok.apply_chat_template([{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": response}], tokenize=False)

    def __call__(self, rows):
        texts = [self._render(r["prompt"], r["chosen"]) for r in rows] + \
                [self._render(r["prompt"], r["rejected"]) for r in rows]
        enc = self.tok(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        enc["margin"] = torch.tensor([float(r.get("margin", 0.0)) for r in rows])
        return enc


def pairwise_loss(rewards, margin, use_margin):
    chosen, rejected = rewards.chunk(2)
    diff = chosen - rejected
    if use_margin:
        diff = diff - margin
    return -F.logsigmoid(diff).mean(), (chosen > rejected).float()


def evaluate(model, loader, accelerator, cfg):
    model.eval()
    accs, losses = [], []
    for batch in loader:
        with torch.no_grad():
            rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        loss, correct = pairwise_loss(rewards.float(), batch["margin"], cfg.margin_loss)
        accs.append(accelerator.gather_for_metrics(correct))
        losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
    model.train()
    return torch.cat(accs).mean().item(), torch.cat(losses).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = RMConfig(**yaml.safe_load(open(ap.parse_args().config)))

    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, log_with="wandb")
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.ERROR)
    set_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"

    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.base_model, num_labels=1, torch_dtype=torch.bfloat16, device_map="auto",
        attn_implementation="flash_attention_2")
    model.config.pad_token_id = tokenizer.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    with accelerator.main_process_first():
        train_ds = load_dataset("json", data_files=cfg.train_data, split="train")
        eval_ds = load_dataset("json", data_files=cfg.eval_data, split="train")
    collate = PairCollator(tokenizer, cfg.max_length)
    train_loader = DataLoader(train_ds, batch_size=cfg.per_device_batch_size, shuffle=True, collate_fn=collate)
    eval_loader = DataLoader(eval_ds, batch_size=cfg.per_device_batch_size * 2, collate_fn=collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps = math.ceil(len(train_loader) / (cfg.grad_accum * accelerator.num_processes)) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * steps), steps)
    # scheduler is stepped by hand once per optimizer update, so it is not passed to prepare()
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    accelerator.init_trackers("reward-model", config=cfg.__dict__)

    step = 0
    for epoch in range(cfg.epochs):
        for batch in train_loader:
            with accelerator.accumulate(model):
                rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss, correct = pairwise_loss(rewards.squeeze(-1).float(), batch["margin"], cfg.margin_loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                scheduler.step()
                step += 1
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
                mean_acc = accelerator.reduce(correct.mean(), reduction="mean")
                accelerator.log({"train/loss": mean_loss.item(), "train/acc": mean_acc.item()}, step=step)
                if step % cfg.eval_every == 0:
                    acc, eval_loss = evaluate(model, eval_loader, accelerator, cfg)
                    accelerator.log({"eval/acc": acc, "eval/loss": eval_loss}, step=step)
                    logger.info("step %d eval acc %.4f loss %.4f", step, acc, eval_loss)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(cfg.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(cfg.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
