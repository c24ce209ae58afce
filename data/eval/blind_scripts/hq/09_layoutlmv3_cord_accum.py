"""LayoutLMv3 token classification on CORD receipts, with gradient accumulation and resumable checkpoints.

    torchrun --nproc_per_node=4 09_layoutlmv3_cord_accum.py --accum 4 --output_dir ckpt/cord_lmv3
    # resume after preemption
    torchrun --nproc_per_node=4 09_layoutlmv3_cord_accum.py --accum 4 --output_dir ckpt/cord_lmv3 --resume
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/layoutlmv3-base")
    ap.add_argument("--dataset", default="nielsr/cord-layoutlmv3")
    ap.add_argument("--output_dir", default="ckpt/cord_lmv3")
    ap.add_argument("--batch_size", type=int, default=2, help="micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup_ratio", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def encode(processor, max_length=512):
    def fn(batch):
        enc = processor(batch["image"], batch["words"], boxes=batch["bboxes"], word_labels=batch["ner_tags"],
                        truncation=True, padding="max_length", max_length=max_length)
        enc["idx"] = [int(i) for i in batch["id"]]
        return enc
    return fn


@torch.no_grad()
def evaluate(model, loader, id2label):
    model.eval()
    local = []
    for batch in loader:
        idx = batch.pop("idx")
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        preds = model(**batch).logits.argmax(-1).cpu()
        labels = batch["labels"].cpu()
        for i, p, l in zip(idx.tolist(), preds, labels):
            keep = l != -100
            local.append((i, [id2label[x] for x in p[keep].tolist()], [id2label[x] for x in l[keep].tolist()]))
    # variable-length sequences: gather as python objects, then drop the sampler's padded repeats
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    seen = {}
    for part in parts:
        for i, p, l in part:
            seen.setdefault(i, (p, l))
    y_pred = [v[0] for v in seen.values()]
    y_true = [v[1] for v in seen.values()]
    model.train()
    return precision_score(y_true, y_pred), recall_score(y_true, y_pred), f1_score(y_true, y_pred)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    raw = load_dataset(args.dataset)
    labels = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(labels))
    processor = AutoProcessor.from_pretrained(args.model, apply_ocr=False)

    if rank != 0:
        dist.barrier()  # wait until rank 0 has written the datasets cache
    cols = raw["train"].column_names
    train_ds = raw["train"].map(encode(processor), batched=True, remove_columns=cols)
    val_ds = raw["validation"].map(encode(processor), batched=True, remove_columns=cols)
    if rank == 0:
        dist.barrier()
    train_ds.set_format("torch")
    val_ds.set_format("torch")

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model, id2label=id2label, label2id={v: k for k, v in id2label.items()}
    ).cuda()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=8, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)
    updates_per_epoch = len(train_dl) // args.accum
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    start_epoch, best_f1 = 0, 0.0
    ckpt_path = os.path.join(args.output_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)
        del ckpt

    model = DDP(model, device_ids=[local_rank])
    # dropout masks may differ per GPU; the weights are already identical after DDP's broadcast
    torch.manual_seed(args.seed + rank)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_dl):
            if i >= updates_per_epoch * args.accum:
                break
            batch.pop("idx")
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

        p, r, f1 = evaluate(model, val_dl, id2label)
        if rank == 0:
            print(f"epoch {epoch} P={p:.4f} R={r:.4f} F1={f1:.4f} "
                  f"(global batch {args.batch_size * args.accum * world}, {time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            best_f1 = max(best_f1, f1)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": best_f1}, ckpt_path)
            if f1 >= best_f1:
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
