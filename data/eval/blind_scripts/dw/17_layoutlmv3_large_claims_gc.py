"""LayoutLMv3-large field tagging on insurance claim forms.

The large model at 512 tokens + 224px patches does not fit batch 8 per A100-40GB, so the
encoder runs with activation checkpointing.

    torchrun --nproc_per_node=8 17_layoutlmv3_large_claims_gc.py \
        --data_files /data/claims/kie/train.jsonl --eval_files /data/claims/kie/dev.jsonl \
        --image_root /data/claims/pages --output_dir /data/claims/runs/lmv3_large_gc
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import Features, Sequence, Value, load_dataset
from PIL import Image
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)

LABELS = [
    "O",
    "B-POLICY_NO", "I-POLICY_NO", "B-CLAIM_NO", "I-CLAIM_NO", "B-INSURED", "I-INSURED",
    "B-DATE_OF_LOSS", "I-DATE_OF_LOSS", "B-AMOUNT", "I-AMOUNT", "B-DIAGNOSIS", "I-DIAGNOSIS",
    "B-PROVIDER", "I-PROVIDER",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_files", required=True)
    p.add_argument("--eval_files", required=True)
    p.add_argument("--image_root", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name", default="microsoft/layoutlmv3-large")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--num_train_epochs", type=int, default=10)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--preprocessing_workers", type=int, default=16)
    return p.parse_args()


def build_dataset(path, processor, image_root, num_proc):
    features = Features({
        "id": Value("string"), "image": Value("string"),
        "words": Sequence(Value("string")), "bboxes": Sequence(Sequence(Value("int64"))),
        "ner_tags": Sequence(Value("string")),
    })
    raw = load_dataset("json", data_files=path, features=features, split="train")

    def prepare(batch):
        images = [Image.open(os.path.join(image_root, p)).convert("RGB") for p in batch["image"]]
        label_ids = [[LABELS.index(t) for t in tags] for tags in batch["ner_tags"]]
        return processor(images, batch["words"], boxes=batch["bboxes"], word_labels=label_ids,
                         truncation=True, padding="max_length", max_length=512)

    ds = raw.map(prepare, batched=True, batch_size=32, num_proc=num_proc, remove_columns=raw.column_names,
                 desc=f"encoding {os.path.basename(path)}")
    ds.set_format("torch")
    return ds


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        for p, l in zip(logits.argmax(-1).tolist(), batch["labels"].tolist()):
            y_true.append([LABELS[x] for x in l if x != -100])
            y_pred.append([LABELS[x] for x, y in zip(p, l) if y != -100])
    model.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (y_true, y_pred))
    y_true = [s for t, _ in gathered for s in t]
    y_pred = [s for _, p in gathered for s in p]
    return f1_score(y_true, y_pred)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)

    # main process tokenises first and fills the datasets cache; the others then load from it
    if rank != 0:
        dist.barrier()
    train_ds = build_dataset(args.data_files, processor, args.image_root, args.preprocessing_workers)
    eval_ds = build_dataset(args.eval_files, processor, args.image_root, args.preprocessing_workers)
    if rank == 0:
        dist.barrier()

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)),
                             batch_size=args.per_device_eval_batch_size, num_workers=2)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
    )
    model.gradient_checkpointing_enable()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim == 1 or "norm" in n.lower() else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    total_steps = args.num_train_epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps)

    best_f1 = 0.0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (%.2fs/it)", epoch, step, len(train_loader),
                            loss.item(), (time.time() - tic) / (step + 1))

        f1 = evaluate(model.module, eval_loader, device)
        if rank == 0:
            logger.info("epoch %d dev entity F1 %.4f", epoch, f1)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        logger.info("best dev entity F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
