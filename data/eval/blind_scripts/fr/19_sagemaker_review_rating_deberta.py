"""Review star-rating model (DeBERTa-v3-base, 5-way) - SageMaker script mode.

huggingface_estimator = HuggingFace(
    entry_point="train_reviews.py", source_dir="./scripts",
    instance_type="ml.g5.12xlarge", instance_count=2,
    transformers_version="4.36", pytorch_version="2.1", py_version="py310",
    distribution={"torch_distributed": {"enabled": True}},
    hyperparameters={"model_name": "microsoft/deberta-v3-base", "epochs": 3, "train_batch_size": 16},
)
huggingface_estimator.fit({"train": "s3://reviews-ml/v2/train", "test": "s3://reviews-ml/v2/test"})
"""
import argparse
import logging
import os
import sys

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, get_scheduler

logger = logging.getLogger(__name__)
logging.basicConfig(level=logging.INFO, handlers=[logging.StreamHandler(sys.stdout)],
                    format="%(asctime)s - %(levelname)s - %(message)s")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", type=str, default="microsoft/deberta-v3-base")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_length", type=int, default=384)
    parser.add_argument("--output_data_dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    parser.add_argument("--model_dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--training_dir", type=str, default=os.environ["SM_CHANNEL_TRAIN"])
    parser.add_argument("--test_dir", type=str, default=os.environ["SM_CHANNEL_TEST"])
    return parser.parse_args()


class ReviewDataset(Dataset):
    def __init__(self, parquet_dir, tokenizer, max_length):
        df = pd.read_parquet(parquet_dir)
        df = df[df["rating"].between(1, 5)]
        self.encodings = tokenizer((df["title"].fillna("") + ". " + df["text"]).tolist(),
                                   truncation=True, max_length=max_length)
        self.labels = (df["rating"].astype(int) - 1).tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        item = {k: v[idx] for k, v in self.encodings.items()}
        item["labels"] = self.labels[idx]
        return item


def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss*n, correct, abs err, n
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            pred = out.logits.argmax(-1)
            n = batch["labels"].numel()
            sums[0] += out.loss.double() * n
            sums[1] += (pred == batch["labels"]).sum()
            sums[2] += (pred - batch["labels"]).abs().sum()
            sums[3] += n
    dist.all_reduce(sums)
    model.train()
    return {"eval_loss": (sums[0] / sums[3]).item(),
            "eval_accuracy": (sums[1] / sums[3]).item(),
            "eval_mae_stars": (sums[2] / sums[3]).item()}


def save_model(model, tokenizer, path):
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    np.random.seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = ReviewDataset(args.training_dir, tokenizer, args.max_length)
    test_ds = ReviewDataset(args.test_dir, tokenizer, args.max_length)
    if rank == 0:
        logger.info(f"loaded train_dataset length is: {len(train_ds)}")
        logger.info(f"loaded test_dataset length is: {len(test_ds)}")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.train_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world_size)),
                             batch_size=args.eval_batch_size, collate_fn=collator, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=5)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    num_training_steps = args.epochs * len(train_loader)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer,
                                 num_warmup_steps=int(args.warmup_ratio * num_training_steps),
                                 num_training_steps=num_training_steps)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                logger.info(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}")

        metrics = evaluate(model, test_loader, device)
        if rank == 0:
            for key, value in sorted(metrics.items()):
                logger.info(f"epoch {epoch} {key} = {value:.4f}")
            with open(os.path.join(args.output_data_dir, f"eval_results_epoch{epoch}.txt"), "w") as writer:
                for key, value in sorted(metrics.items()):
                    writer.write(f"{key} = {value}\n")
            if metrics["eval_accuracy"] > best_acc:
                best_acc = metrics["eval_accuracy"]
                save_model(model, tokenizer, args.model_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
