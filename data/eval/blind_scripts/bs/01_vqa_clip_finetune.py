#!/usr/bin/env python
"""Fine-tune a CLIP backbone with a fused classification head on VQA v2.

    torchrun --nproc_per_node=8 01_vqa_clip_finetune.py \
        --data-root /data/vqa2 --output-dir runs/vqa_clip_b16
"""
import argparse
import json
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPProcessor, CLIPTextModel, CLIPVisionModel, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--clip-name", default="openai/clip-vit-base-patch16")
    p.add_argument("--output-dir", default="runs/vqa_clip")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--head-lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--min-answer-count", type=int, default=9)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


def load_annotations(path):
    with open(path) as f:
        return json.load(f)


def normalize_answer(ans):
    return ans.lower().strip().rstrip(".")


def build_answer_vocab(train_anns, min_count):
    counter = Counter()
    for ann in train_anns:
        for a in ann["answers"]:
            counter[normalize_answer(a["answer"])] += 1
    vocab = {a for a, c in counter.items() if c >= min_count}
    return {a: i for i, a in enumerate(vocab)}


class VQADataset(Dataset):
    def __init__(self, anns, image_dir, ans2label):
        self.anns = anns
        self.image_dir = image_dir
        self.ans2label = ans2label

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, idx):
        ann = self.anns[idx]
        image = Image.open(os.path.join(self.image_dir, ann["image"])).convert("RGB")
        target = torch.zeros(len(self.ans2label))
        counts = Counter(normalize_answer(a["answer"]) for a in ann["answers"])
        for ans, c in counts.items():
            if ans in self.ans2label:
                # standard VQA soft score
                target[self.ans2label[ans]] = min(1.0, c / 3.0)
        return image, ann["question"], target


class Collator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        images, questions, targets = zip(*batch)
        enc = self.processor(text=list(questions), images=list(images), return_tensors="pt",
                             padding="max_length", truncation=True, max_length=40)
        enc["targets"] = torch.stack(targets)
        return enc


class CLIPVQA(nn.Module):
    def __init__(self, clip_name, num_answers):
        super().__init__()
        self.vision = CLIPVisionModel.from_pretrained(clip_name)
        self.text = CLIPTextModel.from_pretrained(clip_name)
        d_img = self.vision.config.hidden_size
        d_txt = self.text.config.hidden_size
        hidden = 1024
        self.img_proj = nn.Linear(d_img, hidden)
        self.txt_proj = nn.Linear(d_txt, hidden)
        self.head = nn.Sequential(
            nn.Linear(hidden * 2, hidden * 2), nn.GELU(), nn.LayerNorm(hidden * 2),
            nn.Dropout(0.1), nn.Linear(hidden * 2, num_answers),
        )

    def forward(self, pixel_values, input_ids, attention_mask):
        img = self.vision(pixel_values=pixel_values).pooler_output
        txt = self.text(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        fused = torch.cat([self.img_proj(img), self.txt_proj(txt)], dim=-1)
        return self.head(fused)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    score = torch.zeros(2, device=device)  # [sum of vqa score, n]
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
        pred = logits.argmax(-1)
        score[0] += batch["targets"].gather(1, pred[:, None]).sum()
        score[1] += pred.numel()
    dist.all_reduce(score)
    model.train()
    return (score[0] / score[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(42 + rank)

    train_anns = load_annotations(os.path.join(args.data_root, "train_qa.json"))
    val_anns = load_annotations(os.path.join(args.data_root, "val_qa.json"))
    ans2label = build_answer_vocab(train_anns, args.min_answer_count)
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world} train={len(train_anns)} val={len(val_anns)} answers={len(ans2label)}")
        with open(os.path.join(args.output_dir, "ans2label.json"), "w") as f:
            json.dump(ans2label, f)

    processor = CLIPProcessor.from_pretrained(args.clip_name)
    collate = Collator(processor)
    image_dir = os.path.join(args.data_root, "images")
    train_ds = VQADataset(train_anns, image_dir, ans2label)
    val_ds = VQADataset(val_anns, image_dir, ans2label)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.workers, collate_fn=collate, pin_memory=True)

    model = CLIPVQA(args.clip_name, len(ans2label)).to(device)
    model = DDP(model, device_ids=[local_rank])

    is_backbone = lambda n: n.startswith(("module.vision.", "module.text."))
    backbone = [p for n, p in model.named_parameters() if is_backbone(n)]
    head = [p for n, p in model.named_parameters() if not is_backbone(n)]
    optimizer = torch.optim.AdamW([
        {"params": backbone, "lr": args.lr},
        {"params": head, "lr": args.head_lr},
    ], weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
            # BCE over soft targets, scaled by num answers as in the bottom-up paper
            loss = F.binary_cross_entropy_with_logits(logits.float(), batch["targets"]) * batch["targets"].size(1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.detach()
            step += 1
            if step % args.log_every == 0:
                dist.all_reduce(running)
                if is_main:
                    print(f"ep {epoch} step {step}/{total_steps} loss {running.item() / (world * args.log_every):.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0):.0f}s")
                running.zero_()

        acc = evaluate(model, val_loader, device)
        if is_main:
            print(f"epoch {epoch}: val VQA acc {acc * 100:.2f}")
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "acc": acc, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output_dir, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    if is_main:
        print(f"done, best val acc {best * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
