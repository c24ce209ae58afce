"""Margin-sampling active learning for AG News with BERT.

Each round fine-tunes bert-base-uncased from the pretrained checkpoint on the
current labelled set, keeps the epoch with the best dev accuracy, and uses that
model to score the unlabelled pool.

Launch:
    torchrun --standalone --nproc_per_node=4 03_al_agnews_bert_margin.py --output_dir /shared/al/agnews_margin
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="bert-base-uncased")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--initial_labelled", type=int, default=200)
    parser.add_argument("--query_size", type=int, default=200)
    parser.add_argument("--num_rounds", type=int, default=15)
    parser.add_argument("--dev_size", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train_batch_size", type=int, default=32, help="global")
    parser.add_argument("--eval_batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_datasets(args, tokenizer, rank):
    # rank 0 downloads / prepares the dataset cache first, the others reuse it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("ag_news")

    def tok(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length)

    encoded = raw.map(tok, batched=True, remove_columns=["text"])
    if rank == 0:
        dist.barrier()
    encoded = encoded.rename_column("label", "labels")
    encoded.set_format("torch", columns=["input_ids", "token_type_ids", "attention_mask", "labels"])
    return encoded["train"], encoded["test"]


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def accuracy(model, dataset, indices, collator, args, device):
    shard = np.array_split(indices, dist.get_world_size())[dist.get_rank()]
    loader = DataLoader(Subset(dataset, shard.tolist()), batch_size=args.eval_batch_size,
                        collate_fn=collator)
    model.eval()
    counts = torch.zeros(2, device=device)
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        preds = model(**batch).logits.argmax(-1)
        counts[0] += (preds == labels).sum()
        counts[1] += labels.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


@torch.no_grad()
def margins(model, dataset, indices, collator, args, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = -(-len(indices) // world)
    shard = indices[rank * per_rank:(rank + 1) * per_rank]
    loader = DataLoader(Subset(dataset, shard.tolist()), batch_size=args.eval_batch_size,
                        collate_fn=collator)
    model.eval()
    out = torch.full((per_rank,), float("inf"), device=device)
    pos = 0
    for batch in loader:
        batch = to_device(batch, device)
        batch.pop("labels")
        probs = model(**batch).logits.float().softmax(-1)
        top2 = probs.topk(2, dim=-1).values
        out[pos:pos + len(top2)] = top2[:, 0] - top2[:, 1]
        pos += len(top2)
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    return torch.cat(gathered)[: len(indices)]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collator = DataCollatorWithPadding(tokenizer)
    train_ds, test_ds = build_datasets(args, tokenizer, rank)

    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(train_ds))
    dev_idx = np.sort(perm[: args.dev_size])
    pool_idx = perm[args.dev_size:]
    labelled = np.sort(pool_idx[: args.initial_labelled])
    unlabelled = np.sort(pool_idx[args.initial_labelled:])
    test_idx = np.arange(len(test_ds))

    os.makedirs(args.output_dir, exist_ok=True)
    best_path = os.path.join(args.output_dir, "best_this_round.pt")
    results = []

    for rnd in range(args.num_rounds):
        model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=4)
        model.to(device)
        model = DDP(model, device_ids=[local_rank])

        sampler = DistributedSampler(Subset(train_ds, labelled.tolist()), shuffle=True, seed=args.seed)
        loader = DataLoader(Subset(train_ds, labelled.tolist()), sampler=sampler,
                            batch_size=args.train_batch_size // world, collate_fn=collator,
                            num_workers=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
        total_steps = args.epochs * len(loader)
        scheduler = get_linear_schedule_with_warmup(
            optimizer, int(args.warmup_ratio * total_steps), total_steps)

        best_dev = -1.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for batch in loader:
                loss = model(**to_device(batch, device)).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            dev_acc = accuracy(model.module, train_ds, dev_idx, collator, args, device)
            if dev_acc > best_dev:
                best_dev = dev_acc
                if rank == 0:
                    torch.save(model.module.state_dict(), best_path)
            dist.barrier()
            logger.info("round %d epoch %d dev acc %.4f", rnd, epoch, dev_acc)

        model.module.load_state_dict(torch.load(best_path))
        test_acc = accuracy(model.module, test_ds, test_idx, collator, args, device)

        scores = margins(model.module, train_ds, unlabelled, collator, args, device)
        k = min(args.query_size, len(unlabelled))
        query = unlabelled[torch.topk(-scores, k).indices.cpu().numpy()]
        labelled = np.sort(np.concatenate([labelled, query]))
        unlabelled = np.setdiff1d(unlabelled, query)

        results.append({"round": rnd, "labelled": int(len(labelled) - k),
                        "dev_acc": best_dev, "test_acc": test_acc})
        if rank == 0:
            logger.info("round %d: %d labelled, test acc %.4f", rnd, len(labelled) - k, test_acc)
            with open(os.path.join(args.output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
            np.save(os.path.join(args.output_dir, f"labelled_round{rnd}.npy"), labelled)
        del model, optimizer
        torch.cuda.empty_cache()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
