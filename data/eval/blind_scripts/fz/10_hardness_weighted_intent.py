"""Intent classification (CLINC150 / banking77) with hardness-aware re-sampling.

Sampling weight of an utterance = class-balancing term * hardness term, where
hardness is 1 - p(gold) from the last epoch's forward pass.  The weights are
refreshed every epoch from the per-sample statistics of all ranks.

    torchrun --nproc_per_node=4 10_hardness_weighted_intent.py --dataset banking77 --model bert-base-uncased
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, WeightedRandomSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="banking77")
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--gamma", type=float, default=1.0, help="exponent on the hardness term")
    p.add_argument("--beta", type=float, default=0.5, help="exponent on inverse class frequency")
    p.add_argument("--output-dir", default="outputs/intent_hardness")
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def collate(batch):
    return {
        "input_ids": torch.tensor([b["input_ids"] for b in batch]),
        "attention_mask": torch.tensor([b["attention_mask"] for b in batch]),
        "labels": torch.tensor([b["label"] for b in batch]),
        "idx": torch.tensor([b["row"] for b in batch]),
    }


def sampling_weights(hardness, labels, num_labels, beta, gamma):
    counts = np.bincount(labels, minlength=num_labels).astype(np.float64)
    cls_w = (1.0 / np.maximum(counts, 1)) ** beta
    w = cls_w[labels] * (0.05 + hardness) ** gamma
    return torch.as_tensor(w / w.sum(), dtype=torch.double)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s [rank%(rank)s] %(message)s", level=logging.INFO if rank == 0 else logging.WARN)
    logger.addFilter(lambda r: setattr(r, "rank", rank) or True)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with_rank0_first = rank == 0
    if not with_rank0_first:
        dist.barrier()
    ds = load_dataset(args.dataset)
    ds = ds.map(lambda b: tokenizer(b["text"], padding="max_length", truncation=True, max_length=args.max_len),
                batched=True)
    ds["train"] = ds["train"].add_column("row", list(range(len(ds["train"]))))
    ds["test"] = ds["test"].add_column("row", list(range(len(ds["test"]))))
    if with_rank0_first:
        dist.barrier()
    train, test = ds["train"], ds["test"]
    labels = np.array(train["label"])
    num_labels = int(labels.max()) + 1
    n = len(train)

    hardness = np.ones(n)
    weights = sampling_weights(hardness, labels, num_labels, args.beta, args.gamma)
    train_sampler = WeightedRandomSampler(weights, num_samples=n, replacement=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, drop_last=True)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=128, collate_fn=collate)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        hard_sum = torch.zeros(n, device=device)
        hard_cnt = torch.zeros(n, device=device)
        for step, batch in enumerate(train_loader):
            idx = batch.pop("idx").to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                p_gold = out.logits.float().softmax(-1).gather(1, batch["labels"][:, None]).squeeze(1)
                hard_sum.index_add_(0, idx, 1.0 - p_gold)
                hard_cnt.index_add_(0, idx, torch.ones_like(p_gold))
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, out.loss.item())

        dist.all_reduce(hard_sum)
        dist.all_reduce(hard_cnt)
        seen = (hard_cnt > 0).cpu().numpy()
        hardness[seen] = (hard_sum[hard_cnt > 0] / hard_cnt[hard_cnt > 0]).cpu().numpy()
        train_sampler.weights = sampling_weights(hardness, labels, num_labels, args.beta, args.gamma)

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in test_loader:
                batch.pop("idx")
                batch = {k: v.to(device) for k, v in batch.items()}
                pred = model.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
                correct[0] += (pred == batch["labels"]).sum()
                correct[1] += batch["labels"].numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        logger.info("epoch %d test acc %.4f (%d train examples with hardness > 0.5)", epoch, acc,
                    int((hardness > 0.5).sum()))
        if rank == 0 and acc > best:
            best = acc
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
