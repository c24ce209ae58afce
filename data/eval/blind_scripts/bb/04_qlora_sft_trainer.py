"""QLoRA instruction tuning with the HF Trainer.

Multi-GPU data parallel through accelerate:

    accelerate launch --multi_gpu --num_processes 4 04_qlora_sft_trainer.py \
        --model_name meta-llama/Meta-Llama-3-8B --dataset_name yahma/alpaca-cleaned --output_dir out/llama3-qlora
"""
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import transformers
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

logger = logging.getLogger(__name__)


@dataclass
class ScriptArguments:
    model_name: str = field(default="meta-llama/Meta-Llama-3-8B")
    dataset_name: str = field(default="yahma/alpaca-cleaned")
    max_seq_length: int = field(default=1024)
    lora_r: int = field(default=64)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.1)
    eval_fraction: float = field(default=0.02)
    use_flash_attn: bool = field(default=True)
    cache_dir: Optional[str] = field(default=None)


TEMPLATE = "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"


def build_tokenize(tokenizer, max_len):
    def _tok(ex):
        input_block = f"### Input:\n{ex['input']}\n\n" if ex["input"] else ""
        prompt = TEMPLATE.format(instruction=ex["instruction"], input_block=input_block)
        p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        r_ids = tokenizer(ex["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p_ids + r_ids)[:max_len]
        labels = ([-100] * len(p_ids) + r_ids)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    return _tok


def main():
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info(f"Training/evaluation parameters {training_args}")

    # defaults that suit QLoRA unless overridden on the command line
    training_args.gradient_checkpointing = True
    training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    training_args.ddp_find_unused_parameters = False
    training_args.remove_unused_columns = False

    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name, cache_dir=script_args.cache_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"

    raw = load_dataset(script_args.dataset_name, split="train", cache_dir=script_args.cache_dir)
    splits = raw.train_test_split(test_size=script_args.eval_fraction, seed=training_args.seed)
    with training_args.main_process_first(desc="tokenizing"):
        tokenized = splits.map(
            build_tokenize(tokenizer, script_args.max_seq_length),
            remove_columns=raw.column_names,
            num_proc=8,
        )

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        script_args.model_name,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        attn_implementation="flash_attention_2" if script_args.use_flash_attn else "sdpa",
        device_map="auto",
        cache_dir=script_args.cache_dir,
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )

    peft_config = LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    if training_args.local_rank in (-1, 0):
        model.print_trainable_parameters()

    collator = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, label_pad_token_id=-100, padding=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["test"],
        data_collator=collator,
        tokenizer=tokenizer,
    )

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and not training_args.overwrite_output_dir:
        last_checkpoint = transformers.trainer_utils.get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None:
            logger.info(f"Resuming from {last_checkpoint}")

    train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
