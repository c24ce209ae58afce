"""
Document image classification on RVL-CDIP (16 classes) with LayoutLMv3,
using OCR words + boxes precomputed with Tesseract (one json per image).

    torchrun --nproc_per_node=8 train_rvl_layoutlmv3.py --data-root /data/rvl-cdip --ocr-root /data/rvl-ocr
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    LayoutLMv3ForSequenceClassification,
    LayoutLMv3Processor,
    get_cosine_schedule_with_warmup,
)

LABELS = ["letter", "form", "email", "handwritten", "advertisement", "scientific report",
          "scientific publication", "specification", "file folder", "news article", "budget",
          "invoice", "presentation", "questionnaire", "resume", "memo"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--ocr-root", required=True)
    p.add_argument("--model", default="microsoft/layoutlmv3-base")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-steps", type=int, default=2000)
    p.add_argument("--out", default="out/rvl_layoutlmv3")
    return p.parse_args()


class RVLDataset(Dataset):
    def __init__(self, root, ocr_root, split, processor):
        with open(os.path.join(root, "labels", f"{split}.txt")) as f:
            self.items = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]
        self.root = root
        self.ocr_root = ocr_root
        self.processor = processor

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, label = self.items[i]
        image = Image.open(os.path.join(self.root, "images", rel)).convert("RGB")
        w, h = image.size
        with open(os.path.join(self.ocr_root, os.path.splitext(rel)[0] + ".json")) as f:
            ocr = json.load(f)
        words = ocr["words"] or ["[EMPTY]"]
        boxes = ocr["boxes"] or [[0, 0, 0, 0]]
        # normalise to the 0-1000 grid LayoutLM expects
        boxes = [[int(1000 * b[0] / w), int(1000 * b[1] / h), int(1000 * b[2] / w), int(1000 * b[3] / h)]
                 for b in boxes]
        boxes = [[min(max(v, 0), 1000) for v in b] for b in boxes]
        enc = self.processor(image, words, boxes=boxes, truncation=True, padding="max_length",
                             max_length=512, return_tensors="pt")
        enc = {k: v.squeeze(0) for k, v in enc.items()}
        enc["labels"] = torch.tensor(label)
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum()
        total += batch["labels"].numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)
    train_ds = RVLDataset(args.data_root, args.ocr_root, "train", processor)
    val_ds = RVLDataset(args.data_root, args.ocr_root, "val", processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = LayoutLMv3ForSequenceClassification.from_pretrained(
        args.model, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or "LayerNorm" in n or "norm" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup * total_updates), total_updates)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, {len(train_ds)} train docs, {total_updates} optimizer updates", flush=True)

    best_acc, update = 0.0, 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (step + 1) % args.grad_accum == 0 or step + 1 == len(train_dl)
            ctx = model.no_sync() if not is_update else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            if not is_update:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 100 == 0:
                print(f"epoch {epoch} update {update}/{total_updates} loss {loss.item() * args.grad_accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

            if update % args.eval_steps == 0:
                acc = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"[eval] update {update} accuracy {acc:.4f}", flush=True)
                    if acc > best_acc:
                        best_acc = acc
                        model.save_pretrained(os.path.join(args.out, "best"))
                        processor.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    acc = evaluate(model, val_dl, device)
    if rank == 0:
        print(f"final val accuracy {acc:.4f}, best {max(acc, best_acc):.4f}")
        torch.save(model.module.state_dict(), os.path.join(args.out, "final_state_dict.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
