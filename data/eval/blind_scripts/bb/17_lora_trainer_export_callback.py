"""LoRA SFT with the HF Trainer on a customer-support dialogue set. Besides the Trainer's own
checkpoints, every save also refreshes `<output_dir>/adapter_latest`, which the eval service
polls and hot-loads.

    accelerate launch --multi_gpu --num_processes 8 17_lora_trainer_export_callback.py \
        --output_dir /mnt/shared/support-bot/run7 --per_device_train_batch_size 8 \
        --gradient_accumulation_steps 2 --learning_rate 1e-4 --num_train_epochs 3 --bf16 \
        --eval_strategy steps --eval_steps 200 --save_steps 200 --logging_steps 10 --report_to none
"""
import json
import os
import shutil
from dataclasses import dataclass

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class Args:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    train_file: str = "data/support_train.jsonl"
    eval_file: str = "data/support_eval.jsonl"
    max_len: int = 2048
    lora_r: int = 16
    lora_alpha: int = 32


class CompletionOnlyCollator:
    """Pads dynamically; loss only on assistant tokens (labels already masked in preprocessing)."""

    def __init__(self, pad_id, multiple=8):
        self.pad_id = pad_id
        self.multiple = multiple

    def __call__(self, feats):
        L = max(len(f["input_ids"]) for f in feats)
        L = ((L + self.multiple - 1) // self.multiple) * self.multiple
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in feats:
            pad = L - len(f["input_ids"])
            batch["input_ids"].append(f["input_ids"] + [self.pad_id] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
            batch["labels"].append(f["labels"] + [-100] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


class ExportAdapterCallback(TrainerCallback):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def on_save(self, args, state, control, model=None, **kwargs):
        export_dir = os.path.join(args.output_dir, "adapter_latest")
        staging = export_dir + ".staging"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, "export_info.json"), "w") as f:
            json.dump({"global_step": state.global_step, "epoch": state.epoch,
                       "best_metric": state.best_metric, "best_model_checkpoint": state.best_model_checkpoint}, f)
        shutil.rmtree(export_dir, ignore_errors=True)
        os.rename(staging, export_dir)


def main():
    script_args, training_args = HfArgumentParser((Args, TrainingArguments)).parse_args_into_dataclasses()
    training_args.remove_unused_columns = False
    training_args.gradient_checkpointing = True
    training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    training_args.ddp_find_unused_parameters = False

    tok = AutoTokenizer.from_pretrained(script_args.model)
    if tok.pad_token is None:
        tok.pad_token = "<|finetune_right_pad_id|>"

    def encode(ex):
        ids, labels = [], []
        msgs = [{"role": "system", "content": ex.get("system") or "You are a helpful support agent."}]
        msgs += ex["messages"]
        for k, m in enumerate(msgs):
            before = tok.apply_chat_template(msgs[:k], tokenize=False) if k else ""
            after = tok.apply_chat_template(msgs[: k + 1], tokenize=False)
            seg = tok(after[len(before):], add_special_tokens=False)["input_ids"]
            ids += seg
            labels += seg if m["role"] == "assistant" else [-100] * len(seg)
        return {"input_ids": ids[: script_args.max_len], "labels": labels[: script_args.max_len]}

    raw = load_dataset("json", data_files={"train": script_args.train_file, "eval": script_args.eval_file})
    with training_args.main_process_first(desc="encode dialogues"):
        enc = raw.map(encode, remove_columns=raw["train"].column_names, num_proc=8)

    model = AutoModelForCausalLM.from_pretrained(script_args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=0.05, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM"))

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=enc["train"],
        eval_dataset=enc["eval"],
        data_collator=CompletionOnlyCollator(tok.pad_token_id),
        callbacks=[ExportAdapterCallback(tok)],
    )
    if trainer.is_world_process_zero():
        model.print_trainable_parameters()

    trainer.train()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_model(os.path.join(training_args.output_dir, "final_adapter"))

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
