"""MNLI fine-tuning for roberta-base, in the style of the old run_glue.py.

    torchrun --nproc_per_node=8 run_mnli.py --data_dir glue_data/MNLI --output_dir out/mnli
"""
import argparse
import csv
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
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)
LABELS = ["contradiction", "entailment", "neutral"]


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quotechar=None))
    header, rows = rows[0], rows[1:]
    i1, i2, il = header.index("sentence1"), header.index("sentence2"), header.index("gold_label")
    return [(r[i1], r[i2], r[il]) for r in rows if r[il] in LABELS]


def load_and_cache_examples(args, tokenizer, split):
    fname = "train.tsv" if split == "train" else "dev_matched.tsv"
    cached_features_file = os.path.join(
        args.data_dir, f"cached_{split}_{os.path.basename(args.model_name_or_path)}_{args.max_seq_length}")
    if os.path.exists(cached_features_file) and not args.overwrite_cache:
        logger.info("Loading features from cached file %s", cached_features_file)
        features = torch.load(cached_features_file)
    else:
        logger.info("Creating features from dataset file at %s", args.data_dir)
        examples = read_tsv(os.path.join(args.data_dir, fname))
        enc = tokenizer([e[0] for e in examples], [e[1] for e in examples], max_length=args.max_seq_length,
                        truncation=True, padding="max_length")
        features = {
            "input_ids": torch.tensor(enc["input_ids"], dtype=torch.long),
            "attention_mask": torch.tensor(enc["attention_mask"], dtype=torch.long),
            "labels": torch.tensor([LABELS.index(e[2]) for e in examples], dtype=torch.long),
        }
        logger.info("Saving features into cached file %s", cached_features_file)
        torch.save(features, cached_features_file)
    return TensorDataset(features["input_ids"], features["attention_mask"], features["labels"])


def set_seed(args):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)


def evaluate(args, model, dataset, device):
    # no shuffling, no padding: each rank takes a contiguous slice of the dev set
    per_rank = (len(dataset) + args.world_size - 1) // args.world_size
    lo, hi = args.rank * per_rank, min(len(dataset), (args.rank + 1) * per_rank)
    subset = torch.utils.data.Subset(dataset, range(lo, hi))
    loader = DataLoader(subset, batch_size=args.per_gpu_eval_batch_size)
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    with torch.no_grad():
        for input_ids, attention_mask, labels in loader:
            logits = model.module(input_ids=input_ids.to(device),
                                  attention_mask=attention_mask.to(device)).logits
            correct += (logits.argmax(-1).cpu() == labels).sum().item()
            count += labels.size(0)
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def train(args, model, tokenizer, device):
    train_dataset = load_and_cache_examples(args, tokenizer, "train")
    dev_dataset = load_and_cache_examples(args, tokenizer, "dev")
    sampler = DistributedSampler(train_dataset)
    loader = DataLoader(train_dataset, sampler=sampler, batch_size=args.per_gpu_train_batch_size,
                        num_workers=2, pin_memory=True)
    t_total = len(loader) // args.gradient_accumulation_steps * args.num_train_epochs
    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * t_total), t_total)

    global_step = 0
    model.zero_grad()
    for epoch in range(int(args.num_train_epochs)):
        sampler.set_epoch(epoch)
        model.train()
        it = tqdm(loader, desc=f"Epoch {epoch}", disable=args.rank != 0)
        for step, (input_ids, attention_mask, labels) in enumerate(it):
            batch = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         labels=labels.to(device))
            is_update = (step + 1) % args.gradient_accumulation_steps == 0
            ctx = model.no_sync() if not is_update else torch.enable_grad()
            with ctx:
                loss = model(**batch).loss / args.gradient_accumulation_steps
                loss.backward()
            if is_update:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                model.zero_grad()
                global_step += 1
                it.set_postfix(loss=f"{loss.item() * args.gradient_accumulation_steps:.4f}")
        acc = evaluate(args, model, dev_dataset, device)
        logger.info("epoch %d global_step %d dev_matched acc = %.4f", epoch, global_step, acc)
        if args.rank == 0:
            out = os.path.join(args.output_dir, f"checkpoint-{global_step}")
            os.makedirs(out, exist_ok=True)
            model.module.save_pretrained(out)
            tokenizer.save_pretrained(out)
        dist.barrier()
    return global_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--model_name_or_path", default="roberta-base")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--per_gpu_train_batch_size", type=int, default=32)
    parser.add_argument("--per_gpu_eval_batch_size", type=int, default=128)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_train_epochs", type=float, default=3.0)
    parser.add_argument("--overwrite_cache", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    args.local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s -   %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S",
                        level=logging.INFO if args.rank == 0 else logging.WARN)
    logger.warning("Process rank: %s, device: %s, world size: %s", args.rank, device, args.world_size)
    set_seed(args)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=len(LABELS))
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    global_step = train(args, model, tokenizer, device)
    logger.info("done, global_step = %s", global_step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
