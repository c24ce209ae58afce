# Fine-tune a BERT/RoBERTa encoder on MNLI (tsv files from GLUE) with plain PyTorch DDP.
#
#   torchrun --nproc_per_node=4 run_mnli.py --model_name_or_path roberta-large \
#       --data_dir glue_data/MNLI --output_dir out/roberta_large_mnli --per_gpu_batch_size 8 --lr 1e-5
#   (4 x 8 = total batch 32, the batch size the 1e-5 learning rate was tuned for)
import argparse
import csv
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)
LABELS = ["contradiction", "entailment", "neutral"]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.reader(f, delimiter="\t", quotechar=None))


def load_and_cache_examples(args, tokenizer, split):
    cached_features_file = os.path.join(
        args.data_dir, "cached_{}_{}_{}".format(split, args.model_name_or_path.split("/")[-1], args.max_seq_length))
    if os.path.exists(cached_features_file) and not args.overwrite_cache:
        logger.info("Loading features from cached file %s", cached_features_file)
        features = torch.load(cached_features_file)
    else:
        logger.info("Creating features from dataset file at %s", args.data_dir)
        fname = "train.tsv" if split == "train" else "dev_matched.tsv"
        lines = read_tsv(os.path.join(args.data_dir, fname))[1:]
        premises = [l[8] for l in lines]
        hypotheses = [l[9] for l in lines]
        labels = [LABELS.index(l[-1]) for l in lines]
        enc = tokenizer(premises, hypotheses, max_length=args.max_seq_length, truncation=True,
                        padding="max_length", return_tensors="pt")
        features = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": torch.tensor(labels, dtype=torch.long)}
        logger.info("Saving features into cached file %s", cached_features_file)
        torch.save(features, cached_features_file)
    return TensorDataset(features["input_ids"], features["attention_mask"], features["labels"])


def evaluate(args, model, eval_dataset, device):
    sampler = DistributedSampler(eval_dataset, shuffle=False, drop_last=False)
    loader = DataLoader(eval_dataset, sampler=sampler, batch_size=args.per_gpu_batch_size * 2)
    model.eval()
    correct = torch.zeros(2, device=device)
    for input_ids, attention_mask, labels in tqdm(loader, disable=args.rank != 0, desc="eval"):
        input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        correct[0] += (logits.argmax(-1) == labels).sum()
        correct[1] += labels.numel()
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def train(args, model, tokenizer, train_dataset, eval_dataset, device):
    sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(train_dataset, sampler=sampler, batch_size=args.per_gpu_batch_size,
                        num_workers=2, pin_memory=True)
    t_total = len(loader) // args.gradient_accumulation_steps * args.num_train_epochs
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * t_total), t_total)

    global_step = 0
    model.zero_grad()
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        pbar = tqdm(loader, disable=args.rank != 0, desc=f"epoch {epoch}")
        for step, (input_ids, attention_mask, labels) in enumerate(pbar):
            input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                model.zero_grad()
                global_step += 1
                if args.rank == 0:
                    pbar.set_postfix(loss=f"{loss.item() * args.gradient_accumulation_steps:.4f}",
                                     lr=f"{scheduler.get_last_lr()[0]:.2e}")
        acc = evaluate(args, model, eval_dataset, device)
        if args.rank == 0:
            logger.info("epoch %d step %d dev-matched acc %.4f", epoch, global_step, acc)
            out = os.path.join(args.output_dir, f"checkpoint-epoch{epoch}")
            os.makedirs(out, exist_ok=True)
            model.module.save_pretrained(out)
            tokenizer.save_pretrained(out)
        dist.barrier()
    return global_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="roberta-large")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--per_gpu_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--overwrite_cache", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    args.rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=logging.INFO if args.rank == 0 else logging.WARN)
    set_seed(args.seed)

    config = AutoConfig.from_pretrained(args.model_name_or_path, num_labels=len(LABELS))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, config=config)
    model.to(device)

    train_dataset = load_and_cache_examples(args, tokenizer, "train")
    eval_dataset = load_and_cache_examples(args, tokenizer, "dev")

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    train(args, model, tokenizer, train_dataset, eval_dataset, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
