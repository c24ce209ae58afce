"""The same Trainer script: the cache is built inside main_process_first(), so
rank 0 writes it while the others wait, then they load it."""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments


def build_cache(texts, tokenizer, cache_file):
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    items = [tokenizer(t).input_ids for t in texts]
    torch.save(items, cache_file)
    return items


def main():
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    with training_args.main_process_first(desc="tokenising"):
        items = build_cache(open("corpus.txt").read().splitlines(), tokenizer, "cache/tokens.pt")
    if training_args.local_rank in (0, -1):
        print(f"{len(items)} examples")
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    Trainer(model=model, args=training_args, train_dataset=items).train()


if __name__ == "__main__":
    main()
