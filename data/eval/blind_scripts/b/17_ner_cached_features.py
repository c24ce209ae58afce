# coding=utf-8
"""
Token classification (NER, CoNLL-2003 format files) with BERT, distributed with torchrun.
Features are cached to disk next to the data so later runs skip tokenization.

    torchrun --nproc_per_node=8 17_ner_cached_features.py \
        --data_dir data/conll2003 --model_name_or_path bert-base-cased --output_dir out/ner
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)
LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
PAD_LABEL_ID = -100


def read_conll(path):
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sentences.append((words, tags))
                    words, tags = [], []
                continue
            parts = line.split()
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        sentences.append((words, tags))
    return sentences


def convert_to_features(sentences, tokenizer, max_len):
    label_map = {l: i for i, l in enumerate(LABELS)}
    all_ids, all_mask, all_labels = [], [], []
    for words, tags in tqdm(sentences, desc="tokenizing"):
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len,
                        padding="max_length")
        labels, prev = [], None
        for wid in enc.word_ids():
            if wid is None or wid == prev:
                labels.append(PAD_LABEL_ID)
            else:
                labels.append(label_map[tags[wid]])
            prev = wid
        all_ids.append(enc["input_ids"])
        all_mask.append(enc["attention_mask"])
        all_labels.append(labels)
    return TensorDataset(torch.tensor(all_ids), torch.tensor(all_mask), torch.tensor(all_labels))


def load_and_cache_examples(args, tokenizer, split):
    cached_file = os.path.join(
        args.data_dir,
        "cached_{}_{}_{}".format(split, args.model_name_or_path.split("/")[-1], args.max_seq_length),
    )
    if os.path.exists(cached_file) and not args.overwrite_cache:
        logger.info("Loading features from cached file %s", cached_file)
        dataset = torch.load(cached_file, weights_only=False)
    else:
        logger.info("Creating features from dataset file at %s", args.data_dir)
        sentences = read_conll(os.path.join(args.data_dir, f"{split}.txt"))
        dataset = convert_to_features(sentences, tokenizer, args.max_seq_length)
        logger.info("Saving features into cached file %s", cached_file)
        torch.save(dataset, cached_file)
    return dataset


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--model_name_or_path", default="bert-base-cased")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--per_gpu_train_batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=0)
    parser.add_argument("--overwrite_cache", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    args.local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=logging.INFO if args.rank == 0 else logging.WARN)
    set_seed(args.seed)

    # make sure only the first process downloads model & vocab
    if args.rank != 0:
        dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForTokenClassification.from_pretrained(args.model_name_or_path, num_labels=len(LABELS))
    if args.rank == 0:
        dist.barrier()

    train_dataset = load_and_cache_examples(args, tokenizer, "train")
    eval_dataset = load_and_cache_examples(args, tokenizer, "valid")

    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.per_gpu_train_batch_size,
                              num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_dataset, sampler=DistributedSampler(eval_dataset, shuffle=False),
                             batch_size=64)

    t_total = len(train_loader) * args.num_train_epochs
    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, t_total)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for input_ids, attention_mask, labels in tqdm(train_loader, disable=args.rank != 0,
                                                      desc=f"epoch {epoch}"):
            input_ids, attention_mask, labels = (t.to(device) for t in (input_ids, attention_mask, labels))
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            outputs.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            model.zero_grad()
            global_step += 1

        # token-level accuracy on the validation split, summed over ranks
        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for input_ids, attention_mask, labels in eval_loader:
                input_ids, attention_mask, labels = (t.to(device) for t in (input_ids, attention_mask, labels))
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                valid = labels != PAD_LABEL_ID
                stats[0] += (logits.argmax(-1)[valid] == labels[valid]).sum()
                stats[1] += valid.sum()
        dist.all_reduce(stats)
        if args.rank == 0:
            logger.info("epoch %d step %d token acc %.4f", epoch, global_step, (stats[0] / stats[1]).item())

    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        model.module.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
        torch.save(args, os.path.join(args.output_dir, "training_args.bin"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
