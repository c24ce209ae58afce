"""
Qwen2-VL LoRA fine-tune on our screenshot-QA data.

accelerate launch --num_processes 4 --mixed_precision bf16 04_vlm_lora_accelerate.py \
    --config configs/qwen2vl_lora.yaml
"""
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration, get_linear_schedule_with_warmup

DEFAULTS = OmegaConf.create({
    "model": {"name": "Qwen/Qwen2-VL-7B-Instruct", "min_pixels": 256 * 28 * 28, "max_pixels": 1024 * 28 * 28},
    "lora": {"r": 32, "alpha": 64, "dropout": 0.05,
             "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "data": {"train": "data/screenqa/train.jsonl", "val": "data/screenqa/val.jsonl",
             "image_root": "data/screenqa/images"},
    "train": {"bsz": 2, "grad_accum": 8, "lr": 1e-4, "epochs": 3, "warmup": 0.05, "seed": 7,
              "out": "out/qwen2vl_screenqa", "log_every": 20},
})


class ScreenQA(Dataset):
    def __init__(self, path, image_root):
        self.rows = [json.loads(l) for l in open(path)]
        self.root = image_root

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        return img, r["question"], r["answer"]


class Collator:
    def __init__(self, processor):
        self.processor = processor
        self.pad_id = processor.tokenizer.pad_token_id

    def __call__(self, batch):
        images, prompts, full = [], [], []
        for img, q, a in batch:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
            prompt = self.processor.apply_chat_template(msgs, add_generation_prompt=True)
            images.append(img)
            prompts.append(prompt)
            full.append(prompt + a + "<|im_end|>")
        enc = self.processor(text=full, images=images, return_tensors="pt", padding=True)
        prompt_enc = self.processor(text=prompts, images=images, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        for j in range(len(batch)):
            n_prompt = int(prompt_enc["attention_mask"][j].sum())
            # right padding: prompt tokens come first
            labels[j, :n_prompt] = -100
        labels[enc["attention_mask"] == 0] = -100
        enc["labels"] = labels
        return enc


def load_model(cfg):
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        cfg.model.name,
        torch_dtype=torch.bfloat16,
        attn_implementation="flash_attention_2",
        device_map="auto",
    )
    model.config.use_cache = False
    for p in model.visual.parameters():
        p.requires_grad_(False)
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=list(cfg.lora.targets), task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = DEFAULTS
    if a.config:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(a.config))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides))

    accelerator = Accelerator(gradient_accumulation_steps=cfg.train.grad_accum, log_with="tensorboard",
                              project_dir=cfg.train.out)
    set_seed(cfg.train.seed)
    accelerator.init_trackers("qwen2vl_lora", config=OmegaConf.to_container(cfg, resolve=True))

    processor = AutoProcessor.from_pretrained(cfg.model.name, min_pixels=cfg.model.min_pixels,
                                              max_pixels=cfg.model.max_pixels)
    processor.tokenizer.padding_side = "right"
    model = load_model(cfg)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    collate = Collator(processor)
    train_dl = DataLoader(ScreenQA(cfg.data.train, cfg.data.image_root), batch_size=cfg.train.bsz,
                          shuffle=True, collate_fn=collate, num_workers=4, drop_last=True)
    val_dl = DataLoader(ScreenQA(cfg.data.val, cfg.data.image_root), batch_size=cfg.train.bsz,
                        shuffle=False, collate_fn=collate, num_workers=4)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                            weight_decay=0.0)
    model, opt, train_dl, val_dl = accelerator.prepare(model, opt, train_dl, val_dl)
    steps_per_epoch = math.ceil(len(train_dl) / cfg.train.grad_accum)
    total = steps_per_epoch * cfg.train.epochs
    # the prepared scheduler advances num_processes times per optimizer step
    n_proc = accelerator.num_processes
    sched = get_linear_schedule_with_warmup(opt, int(cfg.train.warmup * total) * n_proc, total * n_proc)
    sched = accelerator.prepare(sched)

    step = 0
    for epoch in range(cfg.train.epochs):
        model.train()
        pbar = tqdm(train_dl, disable=not accelerator.is_local_main_process, desc=f"epoch {epoch}")
        for batch in pbar:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % cfg.train.log_every == 0:
                    avg = accelerator.reduce(loss.detach(), reduction="mean").item()
                    accelerator.log({"train/loss": avg, "lr": sched.get_last_lr()[0]}, step=step)
                    pbar.set_postfix(loss=f"{avg:.4f}")

        model.eval()
        losses = []
        with torch.no_grad():
            for batch in val_dl:
                loss = model(**batch).loss
                losses.append(accelerator.gather_for_metrics(loss.detach().repeat(batch["input_ids"].size(0))))
        val_loss = torch.cat(losses).mean().item()
        accelerator.log({"val/loss": val_loss}, step=step)
        accelerator.print(f"epoch {epoch}: val_loss={val_loss:.4f}")

        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            out = os.path.join(cfg.train.out, f"epoch{epoch}")
            accelerator.unwrap_model(model).save_pretrained(out)
            processor.save_pretrained(out)

    accelerator.end_training()


if __name__ == "__main__":
    main()
