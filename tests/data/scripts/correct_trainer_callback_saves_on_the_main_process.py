"""LoRA fine-tuning with the Hugging Face Trainer; a callback refreshes
`<output_dir>/adapter_latest` at every save, for a service that hot-loads it.

    accelerate launch --multi_gpu --num_processes 4 correct_trainer_callback_saves_on_the_main_process.py

The Trainer calls its callbacks' hooks in every process: only the main one
(state.is_world_process_zero) writes and renames the folder.
"""

import os
import shutil

from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class ExportAdapterCallback(TrainerCallback):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return  # one writer for the folder every process shares
        latest = os.path.join(args.output_dir, "adapter_latest")
        staging = latest + ".staging"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        shutil.rmtree(latest, ignore_errors=True)
        os.rename(staging, latest)


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained("gpt2"), LoraConfig(r=8, task_type="CAUSAL_LM")
    )
    data = load_dataset("json", data_files="train.jsonl")["train"]
    args = TrainingArguments(output_dir="runs/lora", save_steps=100, per_device_train_batch_size=8)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[ExportAdapterCallback(tokenizer)]
    )
    trainer.train()


if __name__ == "__main__":
    main()
