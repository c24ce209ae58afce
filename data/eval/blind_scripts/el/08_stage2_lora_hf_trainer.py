# Copyright 2024 the VLM team.
"""LLaVA-style stage-2 LoRA instruction tuning with the HF Trainer.

torchrun --nproc_per_node 8 08_stage2_lora_hf_trainer.py \
    --data_path data/llava_v1_5_mix665k_images_only.json --image_folder /data/llava \
    --pretrain_mm_projector runs/stage1/mm_projector.bin \
    --output_dir runs/stage2-lora --bf16 True --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 1 --learning_rate 2e-4 --num_train_epochs 1 \
    --lr_scheduler_type cosine --warmup_ratio 0.03 --logging_steps 10 --save_steps 2000 \
    --report_to wandb --run_name stage2-lora-r128
"""
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          HfArgumentParser, Trainer, TrainingArguments)
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE_INDEX = -100
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the human's questions.")


@dataclass
class ModelArguments:
    model_name_or_path: str = "lmsys/vicuna-7b-v1.5"
    vision_tower: str = "openai/clip-vit-large-patch14-336"
    pretrain_mm_projector: Optional[str] = None
    lora_r: int = 128
    lora_alpha: int = 256
    mm_projector_lr: float = 2e-5


@dataclass
class DataArguments:
    data_path: str = field(default=None)
    image_folder: str = field(default=None)
    model_max_length: int = 2048


class LlavaLlama(nn.Module):
    def __init__(self, llm, vision_tower):
        super().__init__()
        self.llm = llm
        self.vision_tower = vision_tower
        h = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision_tower.config.hidden_size, h), nn.GELU(),
                                          nn.Linear(h, h))
        self.config = llm.config

    def forward(self, input_ids, attention_mask, labels, images):
        with torch.no_grad():
            feats = self.vision_tower(images, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(feats.to(self.mm_projector[0].weight.dtype)).to(torch.bfloat16)
        txt = self.llm.get_input_embeddings()(input_ids)
        bsz, n = img.shape[:2]
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], dim=1)
        mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(bsz, n), attention_mask[:, 1:]], dim=1)
        y = torch.cat([labels[:, :1], labels.new_full((bsz, n), IGNORE_INDEX), labels[:, 1:]], dim=1)
        out = self.llm(inputs_embeds=x, attention_mask=mask, labels=y)
        return CausalLMOutputWithPast(loss=out.loss, logits=out.logits)


def tokenize_fn(example, tokenizer, max_len):
    ids = [tokenizer.bos_token_id] + tokenizer(SYSTEM, add_special_tokens=False).input_ids
    labels = [IGNORE_INDEX] * len(ids)
    for turn in example["conversations"]:
        text = turn["value"].replace("<image>", "").strip()
        if turn["from"] == "human":
            t = tokenizer(" USER: " + text + " ASSISTANT:", add_special_tokens=False).input_ids
            ids, labels = ids + t, labels + [IGNORE_INDEX] * len(t)
        else:
            t = tokenizer(" " + text + tokenizer.eos_token, add_special_tokens=False).input_ids
            ids, labels = ids + t, labels + t
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}


@dataclass
class Collator:
    tokenizer: AutoTokenizer
    processor: CLIPImageProcessor
    image_folder: str

    def __call__(self, features):
        pad = self.tokenizer.pad_token_id
        ids = nn.utils.rnn.pad_sequence([torch.tensor(f["input_ids"]) for f in features], batch_first=True,
                                        padding_value=pad)
        labels = nn.utils.rnn.pad_sequence([torch.tensor(f["labels"]) for f in features], batch_first=True,
                                           padding_value=IGNORE_INDEX)
        images = [Image.open(os.path.join(self.image_folder, f["image"])).convert("RGB") for f in features]
        pixel_values = self.processor(images, return_tensors="pt")["pixel_values"].to(torch.bfloat16)
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad).long(), "images": pixel_values}


class VLMTrainer(Trainer):
    def __init__(self, *args, mm_projector_lr=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mm_projector_lr = mm_projector_lr

    def create_optimizer(self):
        if self.optimizer is None:
            proj = [p for n, p in self.model.named_parameters() if "mm_projector" in n and p.requires_grad]
            rest = [p for n, p in self.model.named_parameters() if "mm_projector" not in n and p.requires_grad]
            groups = [{"params": rest, "weight_decay": self.args.weight_decay},
                      {"params": proj, "weight_decay": 0.0, "lr": self.mm_projector_lr}]
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args)
            self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    def _save(self, output_dir=None, state_dict=None):
        # only the LoRA adapters and the projector; the base weights never change
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        self.model.llm.save_pretrained(output_dir)
        torch.save(self.model.mm_projector.state_dict(), os.path.join(output_dir, "mm_projector.bin"))
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    training_args.remove_unused_columns = False
    training_args.ddp_find_unused_parameters = False

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, use_fast=False,
                                              model_max_length=data_args.model_max_length)
    tokenizer.pad_token = tokenizer.unk_token
    processor = CLIPImageProcessor.from_pretrained(model_args.vision_tower)

    llm = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, torch_dtype=torch.bfloat16,
                                               attn_implementation="flash_attention_2")
    llm.config.use_cache = False
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    llm = get_peft_model(llm, LoraConfig(
        r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=0.05, bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    vision = CLIPVisionModel.from_pretrained(model_args.vision_tower, torch_dtype=torch.bfloat16)
    vision.requires_grad_(False)
    model = LlavaLlama(llm, vision)
    if model_args.pretrain_mm_projector:
        w = torch.load(model_args.pretrain_mm_projector, map_location="cpu")
        model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v for k, v in w.items()})
    if training_args.local_rank in (-1, 0):
        llm.print_trainable_parameters()

    raw = load_dataset("json", data_files=data_args.data_path, split="train")
    with training_args.main_process_first(desc="tokenizing conversations"):
        train_ds = raw.map(tokenize_fn, fn_kwargs=dict(tokenizer=tokenizer, max_len=data_args.model_max_length),
                           remove_columns=[c for c in raw.column_names if c != "image"], num_proc=16)

    trainer = VLMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        data_collator=Collator(tokenizer, processor, data_args.image_folder),
        mm_projector_lr=model_args.mm_projector_lr,
    )
    trainer.train()
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)
        with open(os.path.join(training_args.output_dir, "vlm_config.json"), "w") as f:
            json.dump({"vision_tower": model_args.vision_tower, "mm_projector_type": "mlp2x_gelu",
                       "base_model": model_args.model_name_or_path}, f, indent=2)


if __name__ == "__main__":
    main()
