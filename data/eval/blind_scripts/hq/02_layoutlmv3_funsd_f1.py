"""LayoutLMv3 entity labelling on FUNSD (question / answer / header / other).

torchrun --nproc_per_node=4 02_layoutlmv3_funsd_f1.py --output_dir out/funsd_v3
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoProcessor,
    LayoutLMv3ForTokenClassification,
    get_linear_schedule_with_warmup,
    set_seed,
)

logger = logging.getLogger(__name__)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="microsoft/layoutlmv3-base")
    parser.add_argument("--dataset", default="nielsr/funsd-layoutlmv3")
    parser.add_argument("--output_dir", default="out/funsd_v3")
    parser.add_argument("--max_steps", type=int, default=1000)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--per_device_batch_size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16", action="store_true")
    return parser.parse_args()


def build_features(dataset, processor, max_length):
    def encode(examples):
        enc = processor(
            examples["image"],
            examples["tokens"],
            boxes=examples["bboxes"],
            word_labels=examples["ner_tags"],
            truncation=True,
            padding="max_length",
            max_length=max_length,
        )
        return enc

    cols = dataset.column_names
    ds = dataset.map(encode, batched=True, remove_columns=cols, desc="encoding")
    ds.set_format("torch")
    return ds


@torch.no_grad()
def evaluate(model, loader, id2label, device, world_size):
    model.eval()
    all_preds, all_labels, lengths = [], [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        preds = logits.argmax(-1)
        labels = batch["labels"]
        for p, l in zip(preds, labels):
            keep = l != -100
            all_preds.append(p[keep])
            all_labels.append(l[keep])
            lengths.append(int(keep.sum()))
    preds_flat = torch.cat(all_preds)
    labels_flat = torch.cat(all_labels)
    lengths = torch.tensor(lengths, device=device)

    # collect everything so rank 0 can run seqeval on whole documents
    gathered_lengths = [torch.zeros_like(lengths) for _ in range(world_size)]
    dist.all_gather(gathered_lengths, lengths)
    gathered_preds = [torch.zeros_like(preds_flat) for _ in range(world_size)]
    gathered_labels = [torch.zeros_like(labels_flat) for _ in range(world_size)]
    dist.all_gather(gathered_preds, preds_flat)
    dist.all_gather(gathered_labels, labels_flat)
    model.train()

    if dist.get_rank() != 0:
        return None

    true_seqs, pred_seqs = [], []
    for lens, p_flat, l_flat in zip(gathered_lengths, gathered_preds, gathered_labels):
        offset = 0
        for n in lens.tolist():
            p = p_flat[offset:offset + n].tolist()
            l = l_flat[offset:offset + n].tolist()
            offset += n
            pred_seqs.append([id2label[i] for i in p])
            true_seqs.append([id2label[i] for i in l])
    logger.info("\n%s", classification_report(true_seqs, pred_seqs, digits=4))
    return f1_score(true_seqs, pred_seqs)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(message)s",
        level=logging.INFO if rank == 0 else logging.ERROR,
    )
    set_seed(args.seed)

    raw = load_dataset(args.dataset)
    label_list = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))
    label2id = {v: k for k, v in id2label.items()}

    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)
    # rank 0 fills the datasets cache first, the others then read it back
    if rank != 0:
        dist.barrier()
    train_ds = build_features(raw["train"], processor, args.max_length)
    eval_ds = build_features(raw["test"], processor, args.max_length)
    if rank == 0:
        dist.barrier()

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler, num_workers=4)
    eval_loader = DataLoader(eval_ds, batch_size=8, sampler=eval_sampler, num_workers=2)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model_name, id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * args.max_steps), args.max_steps
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    step, epoch, best_f1 = 0, 0, 0.0
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if rank == 0 and step % 20 == 0:
                logger.info("step %d/%d loss %.4f", step, args.max_steps, loss.item())

            if step % args.eval_every == 0 or step == args.max_steps:
                f1 = evaluate(model, eval_loader, id2label, device, world_size)
                if rank == 0:
                    logger.info("step %d entity F1 %.4f", step, f1)
                    if f1 > best_f1:
                        best_f1 = f1
                        model.module.save_pretrained(args.output_dir)
                        processor.save_pretrained(args.output_dir)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        logger.info("best entity F1: %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
