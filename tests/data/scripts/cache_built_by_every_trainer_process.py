"""A Hugging Face Trainer script (torchrun starts one process per GPU and the
Trainer wraps the model): the tokenised cache is built and torch.saved by
every process at once on the first run."""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments


def build_cache(texts, tokenizer, cache_file):
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    items = [tokenizer(t).input_ids for t in texts]
    torch.save(items, cache_file)  # expect: dataset-cache-race
    return items


def main():
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    items = build_cache(open("corpus.txt").read().splitlines(), tokenizer, "cache/tokens.pt")
    if training_args.local_rank in (0, -1):
        print(f"{len(items)} examples")
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    Trainer(model=model, args=training_args, train_dataset=items).train()


if __name__ == "__main__":
    main()
