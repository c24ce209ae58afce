#!/usr/bin/env python
# Full-parameter chat SFT with the HF Trainer and DeepSpeed ZeRO-3.
#
#   torchrun --nproc_per_node 8 02_chat_sft_zero3_trainer.py \
#       --model_name_or_path mistralai/Mistral-7B-v0.1 \
#       --train_file data/ultrachat_200k_train.jsonl --eval_file data/ultrachat_200k_test.jsonl \
#       --output_dir out/mistral-chat-z3
import argparse
import logging
import os
import sys

import deepspeed
import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.integrations import is_deepspeed_zero3_enabled

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# "auto" values are filled in by the Trainer from TrainingArguments
DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="mistralai/Mistral-7B-v0.1")
    p.add_argument("--train_file", default="data/ultrachat_200k_train.jsonl")
    p.add_argument("--eval_file", default="data/ultrachat_200k_test.jsonl")
    p.add_argument("--output_dir", default="out/mistral-chat-z3")
    p.add_argument("--max_seq_length", type=int, default=2048)
    p.add_argument("--num_eval_samples", type=int, default=2000)
    p.add_argument("--per_device_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--sample_prompts", default="data/sample_prompts.txt")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def tokenize_conversation(example, tokenizer, max_len):
    """Tokenise a multi-turn chat; only assistant turns contribute to the loss."""
    input_ids, labels = [tokenizer.bos_token_id], [-100]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for turn in example["messages"]:
        text = tokenizer.apply_chat_template([turn], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if turn["role"] == "assistant":
            # the "<|im_start|>assistant\n" header stays masked
            lab = [-100] * len(header) + ids[len(header):]
        else:
            lab = [-100] * len(ids)
        input_ids.extend(ids)
        labels.extend(lab)
    input_ids = input_ids[:max_len]
    labels = labels[:max_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def init_new_embeddings(model, old_size, new_size):
    """Initialise rows of newly added tokens to the mean of the existing embeddings."""
    if new_size <= old_size:
        return
    in_emb = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings().weight
    with deepspeed.zero.GatheredParameters([in_emb, out_emb], modifier_rank=0,
                                           enabled=is_deepspeed_zero3_enabled()):
        if torch.distributed.get_rank() == 0:
            in_emb.data[old_size:new_size] = in_emb.data[:old_size].mean(dim=0, keepdim=True)
            out_emb.data[old_size:new_size] = out_emb.data[:old_size].mean(dim=0, keepdim=True)


def generate_samples(model, tokenizer, prompts, device, max_new_tokens=200):
    model.eval()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt").to(device)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                synced_gpus=is_deepspeed_zero3_enabled(),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=im_end,
            )
        outputs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return outputs


def main():
    args = parse_args()
    # TrainingArguments must exist before from_pretrained so ZeRO-3 can partition at load time
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=DS_CONFIG,
        bf16=True,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=0.0,
        warmup_ratio=0.03,
        num_train_epochs=args.epochs,
        max_grad_norm=1.0,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=500,
        save_strategy="steps",
        save_steps=500,
        save_total_limit=2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        remove_unused_columns=False,
        report_to=["tensorboard"],
        seed=args.seed,
    )

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO if training_args.process_index == 0 else logging.WARNING,
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    old_size = len(tokenizer)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"}
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "right"

    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path,
        torch_dtype=torch.bfloat16,
        attn_implementation="flash_attention_2",
    )
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    init_new_embeddings(model, old_size, len(tokenizer))
    model.config.use_cache = False
    model.config.pad_token_id = tokenizer.pad_token_id

    raw = load_dataset("json", data_files={"train": args.train_file, "test": args.eval_file})
    eval_raw = raw["test"].select(range(min(args.num_eval_samples, len(raw["test"]))))
    with training_args.main_process_first(desc="tokenising"):
        fn_kwargs = {"tokenizer": tokenizer, "max_len": args.max_seq_length}
        train_ds = raw["train"].map(tokenize_conversation, fn_kwargs=fn_kwargs, num_proc=16,
                                    remove_columns=raw["train"].column_names)
        eval_ds = eval_raw.map(tokenize_conversation, fn_kwargs=fn_kwargs, num_proc=16,
                               remove_columns=eval_raw.column_names)
        train_ds = train_ds.filter(lambda ex: any(l != -100 for l in ex["labels"]), num_proc=16)

    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, pad_to_multiple_of=8)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        tokenizer=tokenizer,
        data_collator=collator,
    )

    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    # called on every rank: ZeRO-3 gathers the 16-bit weights before rank 0 writes them
    trainer.save_model(training_args.output_dir)

    if args.sample_prompts and os.path.exists(args.sample_prompts):
        with open(args.sample_prompts) as f:
            prompts = [line.strip() for line in f if line.strip()][:8]
        trainer.model.config.use_cache = True
        completions = generate_samples(trainer.model, tokenizer, prompts, training_args.device)
        if trainer.is_world_process_zero():
            with open(os.path.join(args.output_dir, "samples.txt"), "w") as f:
                for p, c in zip(prompts, completions):
                    f.write(f"### PROMPT\n{p}\n### COMPLETION\n{c}\n\n")
            logger.info("wrote %d samples", len(completions))


if __name__ == "__main__":
    main()
