# Qwen2-VL-2B-Instruct SFT on our receipts / forms data with the HF Trainer.
# Text side is pre-tokenized once and cached (the 1.2M-row json takes ~20 min to tokenize);
# image tokens are expanded on the fly in __getitem__ since they depend on image size.
#
# torchrun --nproc_per_node=8 16_qwen2vl_sft_cached.py --data_path data/forms_sft.json \
#   --image_dir data/images --output_dir out/qwen2vl-forms --bf16 True --per_device_train_batch_size 2 \
#   --gradient_accumulation_steps 8 --learning_rate 1e-5 --num_train_epochs 2 --gradient_checkpointing True
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import transformers
from PIL import Image
from torch.utils.data import Dataset
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration, Trainer

IGNORE_INDEX = -100


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="Qwen/Qwen2-VL-2B-Instruct")
    freeze_vision: bool = True
    min_pixels: int = 256 * 28 * 28
    max_pixels: int = 1024 * 28 * 28


@dataclass
class DataArguments:
    data_path: str = field(default=None)
    image_dir: str = field(default=None)
    cache_dir: str = field(default="./cache/sft_tokenized")
    max_len: int = 4096


def build_text_cache(data_path, tokenizer, cache_dir, max_len):
    with open(data_path, "rb") as f:
        key = hashlib.md5(f.read(1 << 24) + tokenizer.name_or_path.encode() + str(max_len).encode()).hexdigest()
    cache_file = os.path.join(cache_dir, f"{key}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)

    os.makedirs(cache_dir, exist_ok=True)
    raw = json.load(open(data_path, "r", encoding="utf-8"))
    items = []
    for ex in raw:
        if not ex.get("image"):
            continue
        ids, labels = [], []
        sys_ids = tokenizer("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n").input_ids
        ids += sys_ids
        labels += [IGNORE_INDEX] * len(sys_ids)
        for turn in ex["messages"]:
            content = turn["content"].replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
            if turn["role"] == "user":
                t = tokenizer(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n").input_ids
                ids += t
                labels += [IGNORE_INDEX] * len(t)
            else:
                t = tokenizer(f"{content}<|im_end|>\n").input_ids
                ids += t
                labels += t
        if len(ids) > max_len:
            continue
        items.append({"input_ids": ids, "labels": labels, "image": ex["image"]})
    torch.save(items, cache_file)
    return items


class FormsDataset(Dataset):
    def __init__(self, items, image_dir, processor):
        self.items = items
        self.image_dir = image_dir
        self.processor = processor
        self.pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.merge = processor.image_processor.merge_size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        ids, labels = list(it["input_ids"]), list(it["labels"])
        img = Image.open(os.path.join(self.image_dir, it["image"])).convert("RGB")
        vis = self.processor.image_processor(images=[img], return_tensors="pt")
        n = int(vis["image_grid_thw"][0].prod()) // (self.merge ** 2)
        p = ids.index(self.pad_id)
        ids = ids[:p] + [self.pad_id] * n + ids[p + 1:]
        labels = labels[:p] + [IGNORE_INDEX] * n + labels[p + 1:]
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "pixel_values": vis["pixel_values"],
            "image_grid_thw": vis["image_grid_thw"],
        }


@dataclass
class Collator:
    pad_token_id: int

    def __call__(self, batch: List[Dict]) -> Dict[str, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True,
                                              padding_value=self.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True,
                                                 padding_value=IGNORE_INDEX)
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": ids.ne(self.pad_token_id),
            "pixel_values": torch.cat([b["pixel_values"] for b in batch]),
            "image_grid_thw": torch.cat([b["image_grid_thw"] for b in batch]),
        }


def main():
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, transformers.TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    training_args.remove_unused_columns = False
    training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}

    processor = AutoProcessor.from_pretrained(
        model_args.model_name_or_path, min_pixels=model_args.min_pixels, max_pixels=model_args.max_pixels
    )
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        model_args.model_name_or_path,
        torch_dtype=torch.bfloat16 if training_args.bf16 else torch.float32,
        attn_implementation="flash_attention_2",
    )
    model.config.use_cache = False
    if model_args.freeze_vision:
        model.visual.requires_grad_(False)
        model.visual.merger.requires_grad_(True)

    items = build_text_cache(data_args.data_path, processor.tokenizer, data_args.cache_dir, data_args.max_len)
    train_dataset = FormsDataset(items, data_args.image_dir, processor)
    if training_args.local_rank in (0, -1):
        print(f"{len(train_dataset)} samples after filtering (max_len={data_args.max_len})")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=Collator(processor.tokenizer.pad_token_id),
    )
    resume = os.path.isdir(training_args.output_dir) and any(
        d.startswith("checkpoint-") for d in os.listdir(training_args.output_dir)
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        processor.save_pretrained(training_args.output_dir)


if __name__ == "__main__":
    main()
