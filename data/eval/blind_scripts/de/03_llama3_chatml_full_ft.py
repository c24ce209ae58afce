#!/usr/bin/env python
"""Full fine-tuning of Llama-3-8B on ChatML-formatted instruction data.

    torchrun --nproc_per_node=8 --master_port=29511 03_llama3_chatml_full_ft.py \
        --model_name_or_path meta-llama/Meta-Llama-3-8B \
        --data_path data/openhermes_chatml.jsonl \
        --output_dir out/llama3-8b-chatml \
        --bf16 True --num_train_epochs 3 \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 \
        --learning_rate 2e-5 --warmup_ratio 0.03 --lr_scheduler_type cosine \
        --logging_steps 10 --save_strategy steps --save_steps 1000 --save_total_limit 2 \
        --gradient_checkpointing True --deepspeed configs/ds_zero3.json
"""
import copy
import json
import logging
import random
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch
import transformers
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.integrations import is_deepspeed_zero3_enabled

IGNORE_INDEX = -100
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_PAD_TOKEN = "<|pad|>"

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default="meta-llama/Meta-Llama-3-8B")
    use_flash_attn: bool = field(default=True)


@dataclass
class DataArguments:
    data_path: str = field(default=None, metadata={"help": "Path to the chat jsonl."})
    eval_fraction: float = field(default=0.01)
    sample_prompts: Optional[str] = field(default=None)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    cache_dir: Optional[str] = field(default=None)
    optim: str = field(default="adamw_torch")
    model_max_length: int = field(default=4096, metadata={"help": "Maximum sequence length."})


def smart_tokenizer_and_embedding_resize(special_tokens_dict: Dict, tokenizer, model):
    """Resize tokenizer and embedding; new rows start at the mean of the old ones."""
    num_new_tokens = tokenizer.add_special_tokens(special_tokens_dict)
    model.resize_token_embeddings(len(tokenizer))

    if num_new_tokens > 0:
        input_embeddings = model.get_input_embeddings().weight.data
        output_embeddings = model.get_output_embeddings().weight.data

        input_embeddings_avg = input_embeddings[:-num_new_tokens].mean(dim=0, keepdim=True)
        output_embeddings_avg = output_embeddings[:-num_new_tokens].mean(dim=0, keepdim=True)

        input_embeddings[-num_new_tokens:] = input_embeddings_avg
        output_embeddings[-num_new_tokens:] = output_embeddings_avg
    return num_new_tokens


def render_turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def preprocess_conversation(conv: Sequence[Dict], tokenizer, max_len: int) -> Dict:
    input_ids = [tokenizer.bos_token_id]
    labels = [IGNORE_INDEX]
    for turn in conv:
        role = {"human": "user", "gpt": "assistant", "system": "system"}.get(turn["from"], turn["from"])
        text = render_turn(role, turn["value"])
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if role == "assistant":
            prefix_len = len(tokenizer(f"{IM_START}assistant\n", add_special_tokens=False).input_ids)
            turn_labels = [IGNORE_INDEX] * prefix_len + ids[prefix_len:]
        else:
            turn_labels = [IGNORE_INDEX] * len(ids)
        input_ids += ids
        labels += turn_labels
    return dict(input_ids=input_ids[:max_len], labels=labels[:max_len])


class SupervisedDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        super().__init__()
        self.examples = []
        for rec in records:
            ex = preprocess_conversation(rec["conversations"], tokenizer, max_len)
            if any(l != IGNORE_INDEX for l in ex["labels"]):
                self.examples.append(ex)

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i) -> Dict[str, torch.Tensor]:
        ex = self.examples[i]
        return dict(input_ids=torch.tensor(ex["input_ids"]), labels=torch.tensor(ex["labels"]))


@dataclass
class DataCollatorForSupervisedDataset:
    tokenizer: transformers.PreTrainedTokenizer

    def __call__(self, instances: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        input_ids = [inst["input_ids"] for inst in instances]
        labels = [inst["labels"] for inst in instances]
        input_ids = torch.nn.utils.rnn.pad_sequence(input_ids, batch_first=True,
                                                    padding_value=self.tokenizer.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
        return dict(input_ids=input_ids, labels=labels,
                    attention_mask=input_ids.ne(self.tokenizer.pad_token_id))


def make_supervised_data_module(tokenizer, data_args, max_len, seed) -> Dict:
    with open(data_args.data_path) as f:
        records = [json.loads(line) for line in f]
    rng = random.Random(seed)
    rng.shuffle(records)
    n_eval = max(1, int(len(records) * data_args.eval_fraction))
    eval_dataset = SupervisedDataset(records[:n_eval], tokenizer, max_len)
    train_dataset = SupervisedDataset(records[n_eval:], tokenizer, max_len)
    logger.info("train=%d eval=%d", len(train_dataset), len(eval_dataset))
    return dict(train_dataset=train_dataset, eval_dataset=eval_dataset,
                data_collator=DataCollatorForSupervisedDataset(tokenizer=tokenizer))


@torch.no_grad()
def write_samples(trainer, tokenizer, prompts, path):
    model = trainer.model
    model.eval()
    model.config.use_cache = True
    lines = []
    for prompt in prompts:
        text = render_turn("user", prompt) + f"{IM_START}assistant\n"
        enc = tokenizer(text, return_tensors="pt").to(trainer.args.device)
        out = model.generate(**enc, max_new_tokens=256, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                             pad_token_id=tokenizer.pad_token_id,
                             synced_gpus=is_deepspeed_zero3_enabled())
        lines.append({"prompt": prompt,
                      "completion": tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)})
    if trainer.is_world_process_zero():
        with open(path, "w") as f:
            for rec in lines:
                f.write(json.dumps(rec) + "\n")


def train():
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if training_args.local_rank in (-1, 0) else logging.WARN)
    transformers.set_seed(training_args.seed)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        cache_dir=training_args.cache_dir,
        torch_dtype=torch.bfloat16 if training_args.bf16 else None,
        attn_implementation="flash_attention_2" if model_args.use_flash_attn else "sdpa",
    )
    model.config.use_cache = False

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        cache_dir=training_args.cache_dir,
        model_max_length=training_args.model_max_length,
        padding_side="right",
        use_fast=True,
    )
    special_tokens = {"additional_special_tokens": [IM_START, IM_END]}
    if tokenizer.pad_token is None:
        special_tokens["pad_token"] = DEFAULT_PAD_TOKEN
    smart_tokenizer_and_embedding_resize(special_tokens, tokenizer, model)
    model.config.pad_token_id = tokenizer.pad_token_id

    data_module = make_supervised_data_module(tokenizer, data_args, training_args.model_max_length,
                                              training_args.seed)
    trainer = Trainer(model=model, tokenizer=tokenizer, args=training_args, **data_module)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_state()
    trainer.save_model(output_dir=training_args.output_dir)

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    if data_args.sample_prompts:
        with open(data_args.sample_prompts) as f:
            prompts = [l.strip() for l in f if l.strip()][:16]
        write_samples(trainer, tokenizer, prompts, f"{training_args.output_dir}/samples.jsonl")


if __name__ == "__main__":
    train()
