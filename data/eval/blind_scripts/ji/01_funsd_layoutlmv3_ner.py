#!/usr/bin/env python
"""Fine-tune LayoutLMv3 on FUNSD entity labeling (question / answer / header) with DDP.

    torchrun --nproc_per_node=4 01_funsd_layoutlmv3_ner.py --output_dir runs/funsd_v3_base
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("funsd")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="microsoft/layoutlmv3-base")
    p.add_argument("--dataset", default="nielsr/funsd-layoutlmv3")
    p.add_argument("--output_dir", default="runs/funsd")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_datasets(args, processor, rank):
    raw = load_dataset(args.dataset)
    label_list = raw["train"].features["ner_tags"].feature.names

    def encode(batch):
        images = [im.convert("RGB") for im in batch["image"]]
        enc = processor(
            images,
            batch["tokens"],
            boxes=batch["bboxes"],
            word_labels=batch["ner_tags"],
            truncation=True,
            padding="max_length",
            max_length=args.max_length,
        )
        return enc

    # let rank 0 fill the datasets cache, the others read it afterwards
    if rank != 0:
        dist.barrier()
    cols = raw["train"].column_names
    train_ds = raw["train"].map(encode, batched=True, remove_columns=cols, desc="encode train")
    test_ds = raw["test"].map(encode, batched=True, remove_columns=cols, desc="encode test")
    if rank == 0:
        dist.barrier()

    train_ds.set_format("torch")
    test_ds.set_format("torch")
    return train_ds, test_ds, label_list


@torch.no_grad()
def evaluate(model, loader, label_list, device, amp):
    model.eval()
    all_true, all_pred = [], []
    total_loss, n_batches = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = model(**batch)
        total_loss += out.loss.item()
        n_batches += 1
        preds = out.logits.argmax(-1).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        for p_row, l_row in zip(preds, labels):
            keep = l_row != -100
            all_true.append([label_list[i] for i in l_row[keep]])
            all_pred.append([label_list[i] for i in p_row[keep]])
    model.train()
    return {
        "loss": total_loss / max(n_batches, 1),
        "precision": precision_score(all_true, all_pred),
        "recall": recall_score(all_true, all_pred),
        "f1": f1_score(all_true, all_pred),
    }


def save_checkpoint(model, optimizer, scheduler, epoch, best_f1, path):
    torch.save(
        {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_f1": best_f1,
        },
        path,
    )


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
    )
    seed_everything(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)
    train_ds, test_ds, label_list = build_datasets(args, processor, rank)
    id2label = dict(enumerate(label_list))
    label2id = {v: k for k, v in id2label.items()}

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.num_workers, pin_memory=True, drop_last=True,
    )
    test_loader = DataLoader(
        test_ds, batch_size=args.batch_size, sampler=test_sampler,
        num_workers=args.num_workers, pin_memory=True,
    )

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    logger.info("train pages=%d test pages=%d world=%d steps=%d",
                len(train_ds), len(test_ds), world_size, total_steps)

    best_f1 = 0.0
    history = []
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = 0.0
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.item()
            step += 1
            if step % 20 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e",
                            epoch, step, running / 20, scheduler.get_last_lr()[0])
                running = 0.0

        logger.info("epoch %d done in %.1fs", epoch, time.time() - t0)

        if (epoch + 1) % args.eval_every == 0 or epoch == args.epochs - 1:
            metrics = evaluate(model, test_loader, label_list, device, args.amp)
            if rank == 0:
                metrics["epoch"] = epoch
                history.append(metrics)
                logger.info("eval epoch %d: P=%.4f R=%.4f F1=%.4f loss=%.4f", epoch,
                            metrics["precision"], metrics["recall"], metrics["f1"], metrics["loss"])
                if metrics["f1"] > best_f1:
                    best_f1 = metrics["f1"]
                    save_checkpoint(model, optimizer, scheduler, epoch, best_f1,
                                    os.path.join(args.output_dir, "best.pt"))
                save_checkpoint(model, optimizer, scheduler, epoch, best_f1,
                                os.path.join(args.output_dir, "last.pt"))
            dist.barrier()

    if rank == 0:
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump({"best_f1": best_f1, "history": history}, f, indent=2)
        logger.info("best entity F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
