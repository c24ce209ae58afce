"""Fine-tune Pix2Struct-large on InfographicVQA, data parallel.

    torchrun --nproc_per_node=4 11_pix2struct_infographicvqa.py \
        --train /data/infovqa/train.jsonl --val /data/infovqa/val.jsonl --images /data/infovqa/images
"""
import argparse
import json
import math
import os
import time

import editdistance
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Pix2StructForConditionalGeneration, Pix2StructProcessor
from transformers.optimization import Adafactor, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/pix2struct-infographics-vqa-large")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", default="runs/p2s_infovqa")
    ap.add_argument("--max_patches", type=int, default=2048)
    ap.add_argument("--max_target_len", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup_steps", type=int, default=500)
    return ap.parse_args()


def anls(pred, golds, tau=0.5):
    best = 0.0
    for g in golds:
        p, g = pred.lower().strip(), g.lower().strip()
        if not p and not g:
            return 1.0
        nl = editdistance.eval(p, g) / max(len(p), len(g))
        best = max(best, 1 - nl if nl < tau else 0.0)
    return best


class InfoVQA(Dataset):
    def __init__(self, jsonl, image_dir):
        with open(jsonl) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {
            "image": Image.open(os.path.join(self.image_dir, r["image_local_name"])).convert("RGB"),
            "question": r["question"],
            "answers": r["answers"],
        }


class Collator:
    def __init__(self, processor, max_patches, max_target_len):
        self.processor = processor
        self.max_patches = max_patches
        self.max_target_len = max_target_len

    def __call__(self, batch):
        enc = self.processor(
            images=[b["image"] for b in batch],
            text=[b["question"] for b in batch],
            max_patches=self.max_patches,
            return_tensors="pt",
        )
        tgt = self.processor.tokenizer(
            [b["answers"][0] for b in batch], padding="longest", truncation=True,
            max_length=self.max_target_len, return_tensors="pt",
        ).input_ids
        tgt[tgt == self.processor.tokenizer.pad_token_id] = -100
        return {
            "flattened_patches": enc["flattened_patches"],
            "attention_mask": enc["attention_mask"],
            "labels": tgt,
            "answers": [b["answers"] for b in batch],
        }


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for batch in loader:
        gen = model.module.generate(
            flattened_patches=batch["flattened_patches"].to(device, torch.bfloat16),
            attention_mask=batch["attention_mask"].to(device),
            max_new_tokens=32,
        )
        preds = processor.batch_decode(gen, skip_special_tokens=True)
        for pred, golds in zip(preds, batch["answers"]):
            total[0] += anls(pred, golds)
            total[1] += 1
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    processor = Pix2StructProcessor.from_pretrained(args.model)
    model = Pix2StructForConditionalGeneration.from_pretrained(
        args.model, torch_dtype=torch.bfloat16, device_map="auto"
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    train_ds, val_ds = InfoVQA(args.train, args.images), InfoVQA(args.val, args.images)
    collate = Collator(processor, args.max_patches, args.max_target_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=8)

    optimizer = Adafactor(model.parameters(), lr=args.lr, scale_parameter=False, relative_step=False,
                          warmup_init=False, weight_decay=1e-5)
    updates = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, updates)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            last_micro = (i + 1) % args.grad_accum == 0 or i + 1 == len(train_loader)
            inputs = {
                "flattened_patches": batch["flattened_patches"].to(device, torch.bfloat16),
                "attention_mask": batch["attention_mask"].to(device),
                "labels": batch["labels"].to(device),
            }
            if last_micro:
                loss = model(**inputs).loss / args.grad_accum
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = model(**inputs).loss / args.grad_accum
                    loss.backward()
            if rank == 0 and i % (50 * args.grad_accum) == 0:
                print(f"epoch {epoch} batch {i}/{len(train_loader)} loss {loss.item() * args.grad_accum:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        score = evaluate(model, val_loader, processor, device)
        if rank == 0:
            print(f"epoch {epoch}: val ANLS {score:.4f} ({world} GPUs)", flush=True)
            if score > best:
                best = score
                model.module.save_pretrained(args.out)
                processor.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
