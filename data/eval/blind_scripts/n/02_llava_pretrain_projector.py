# Stage-1 feature alignment (projector-only pretraining), LLaVA style.
# Frozen CLIP ViT-L/14-336 + frozen LLM, only mm_projector trains.
# Launched with deepspeed + the zero3.json from scripts/.
import copy
import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import transformers
from PIL import Image
from torch.utils.data import Dataset
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, LlamaForCausalLM, Trainer

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200
DEFAULT_IMAGE_TOKEN = "<image>"

local_rank = None


def rank0_print(*args):
    if local_rank == 0:
        print(*args)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="lmsys/vicuna-7b-v1.5")
    vision_tower: str = field(default="openai/clip-vit-large-patch14-336")
    mm_vision_select_layer: int = field(default=-2)
    mm_projector_type: str = field(default="mlp2x_gelu")


@dataclass
class DataArguments:
    data_path: str = field(default=None)
    image_folder: str = field(default=None)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    model_max_length: int = field(default=2048)
    tune_mm_mlp_adapter: bool = field(default=True)


def build_projector(projector_type, mm_hidden, hidden):
    if projector_type == "linear":
        return nn.Linear(mm_hidden, hidden)
    if projector_type == "mlp2x_gelu":
        return nn.Sequential(nn.Linear(mm_hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))
    raise ValueError(projector_type)


class LlavaLlama(nn.Module):
    def __init__(self, model_args, torch_dtype):
        super().__init__()
        self.llm = LlamaForCausalLM.from_pretrained(model_args.model_name_or_path, torch_dtype=torch_dtype)
        self.vision_tower = CLIPVisionModel.from_pretrained(model_args.vision_tower, torch_dtype=torch_dtype)
        self.select_layer = model_args.mm_vision_select_layer
        self.mm_projector = build_projector(
            model_args.mm_projector_type,
            self.vision_tower.config.hidden_size,
            self.llm.config.hidden_size,
        )
        self.config = self.llm.config

    def get_model(self):
        return self

    def encode_images(self, images):
        with torch.no_grad():
            out = self.vision_tower(images, output_hidden_states=True)
            feats = out.hidden_states[self.select_layer][:, 1:]
        return self.mm_projector(feats.to(self.mm_projector[0].weight.dtype))

    def forward(self, input_ids, labels, attention_mask, images):
        image_features = self.encode_images(images)
        embed = self.llm.get_input_embeddings()
        new_embeds, new_labels = [], []
        for b in range(input_ids.shape[0]):
            ids = input_ids[b]
            pos = (ids == IMAGE_TOKEN_INDEX).nonzero(as_tuple=True)[0]
            p = pos[0].item() if len(pos) else 0
            before = embed(ids[:p].clamp(min=0))
            after = embed(ids[p + 1 :].clamp(min=0))
            img = image_features[b]
            new_embeds.append(torch.cat([before, img, after], dim=0))
            lab = labels[b]
            new_labels.append(
                torch.cat(
                    [lab[:p], torch.full((img.shape[0],), IGNORE_INDEX, device=lab.device, dtype=lab.dtype), lab[p + 1 :]]
                )
            )
        max_len = max(x.shape[0] for x in new_embeds)
        emb = torch.zeros(len(new_embeds), max_len, new_embeds[0].shape[-1], dtype=new_embeds[0].dtype, device=input_ids.device)
        lab = torch.full((len(new_embeds), max_len), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        att = torch.zeros(len(new_embeds), max_len, dtype=torch.bool, device=input_ids.device)
        for i, (e, l) in enumerate(zip(new_embeds, new_labels)):
            emb[i, : e.shape[0]] = e
            lab[i, : l.shape[0]] = l
            att[i, : e.shape[0]] = True
        return self.llm(inputs_embeds=emb, attention_mask=att, labels=lab)


def tokenizer_image_token(prompt, tokenizer):
    chunks = [tokenizer(c).input_ids for c in prompt.split(DEFAULT_IMAGE_TOKEN)]
    ids = chunks[0]
    for c in chunks[1:]:
        ids = ids + [IMAGE_TOKEN_INDEX] + c[1:]
    return ids


class PretrainDataset(Dataset):
    def __init__(self, data_path, image_folder, tokenizer, image_processor):
        self.items = json.load(open(data_path, "r"))
        self.image_folder = image_folder
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        rank0_print(f"Loaded {len(self.items)} caption pairs")

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        image = Image.open(os.path.join(self.image_folder, item["image"])).convert("RGB")
        pixel_values = self.image_processor(image, return_tensors="pt")["pixel_values"][0]
        caption = item["conversations"][1]["value"]
        prompt = DEFAULT_IMAGE_TOKEN + caption + self.tokenizer.eos_token
        input_ids = torch.tensor(tokenizer_image_token(prompt, self.tokenizer)[: self.tokenizer.model_max_length])
        labels = input_ids.clone()
        labels[:2] = IGNORE_INDEX  # bos + image
        return dict(input_ids=input_ids, labels=labels, image=pixel_values)


@dataclass
class DataCollator:
    tokenizer: transformers.PreTrainedTokenizer

    def __call__(self, instances: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        input_ids = torch.nn.utils.rnn.pad_sequence(
            [x["input_ids"] for x in instances], batch_first=True, padding_value=self.tokenizer.pad_token_id
        )
        labels = torch.nn.utils.rnn.pad_sequence([x["labels"] for x in instances], batch_first=True, padding_value=IGNORE_INDEX)
        return dict(
            input_ids=input_ids,
            labels=labels,
            attention_mask=input_ids.ne(self.tokenizer.pad_token_id),
            images=torch.stack([x["image"] for x in instances]),
        )


class ProjectorTrainer(Trainer):
    def _save_checkpoint(self, model, trial, metrics=None):
        checkpoint_folder = f"checkpoint-{self.state.global_step}"
        output_dir = os.path.join(self.args.output_dir, checkpoint_folder)
        self._save_projector(output_dir)

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        self._save_projector(output_dir or self.args.output_dir)

    def _save_projector(self, output_dir):
        if self.args.local_rank in (0, -1):
            os.makedirs(output_dir, exist_ok=True)
            projector = self.model.get_model().mm_projector
            weights = {f"model.mm_projector.{k}": v.detach().cpu() for k, v in projector.state_dict().items()}
            torch.save(weights, os.path.join(output_dir, "mm_projector.bin"))
            self.model.config.save_pretrained(output_dir)


def train():
    global local_rank
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    local_rank = training_args.local_rank
    dtype = torch.bfloat16 if training_args.bf16 else (torch.float16 if training_args.fp16 else torch.float32)

    model = LlavaLlama(model_args, dtype)
    model.llm.config.use_cache = False
    model.llm.requires_grad_(False)
    model.vision_tower.requires_grad_(False)
    for p in model.mm_projector.parameters():
        p.requires_grad = True

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, model_max_length=training_args.model_max_length, padding_side="right", use_fast=False
    )
    tokenizer.pad_token = tokenizer.unk_token
    image_processor = CLIPImageProcessor.from_pretrained(model_args.vision_tower)

    train_dataset = PretrainDataset(data_args.data_path, data_args.image_folder, tokenizer, image_processor)
    trainer = ProjectorTrainer(
        model=model,
        tokenizer=tokenizer,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=DataCollator(tokenizer),
    )

    if list(pathlib.Path(training_args.output_dir).glob("checkpoint-*")):
        trainer.train(resume_from_checkpoint=True)
    else:
        trainer.train()
    trainer.save_state()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    train()
