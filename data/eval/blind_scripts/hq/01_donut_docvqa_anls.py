#!/usr/bin/env python
"""Fine-tune Donut on DocVQA-style page question answering with DDP.

    torchrun --nproc_per_node=8 01_donut_docvqa_anls.py \
        --data_dir /data/docvqa --output_dir runs/donut_docvqa --bf16

The data dir holds train.jsonl / val.jsonl with one record per question:
    {"questionId": 337, "image": "documents/xnbl0037_1.png",
     "question": "what is the date mentioned in this letter?", "answers": ["1/8/93"]}
"""
import argparse
import json
import logging
import math
import os
import random
import re
import time

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logger = logging.getLogger("donut_docvqa")

TASK_TOKEN = "<s_docvqa>"
EXTRA_TOKENS = [TASK_TOKEN, "<s_question>", "</s_question>", "<s_answer>", "</s_answer>"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    p.add_argument("--output_dir", default="runs/donut_docvqa")
    p.add_argument("--image_size", type=int, nargs=2, default=[2560, 1920], help="height width")
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup_steps", type=int, default=300)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=2022)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


def levenshtein(a, b):
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(pred, answers, threshold=0.5):
    pred = " ".join(pred.strip().lower().split())
    best = 0.0
    for gt in answers:
        gt = " ".join(gt.strip().lower().split())
        denom = max(len(pred), len(gt))
        if denom == 0:
            return 1.0
        nl = levenshtein(pred, gt) / denom
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


class DocVQADataset(Dataset):
    def __init__(self, data_dir, split, processor, max_length):
        self.data_dir = data_dir
        self.split = split
        self.processor = processor
        self.max_length = max_length
        with open(os.path.join(data_dir, f"{split}.jsonl")) as f:
            self.records = [json.loads(line) for line in f if line.strip()]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        image = Image.open(os.path.join(self.data_dir, rec["image"])).convert("RGB")
        pixel_values = self.processor(image, return_tensors="pt").pixel_values[0]
        prompt = f"{TASK_TOKEN}<s_question>{rec['question']}</s_question><s_answer>"
        tok = self.processor.tokenizer
        if self.split != "train":
            prompt_ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids[0]
            return {"pixel_values": pixel_values, "prompt_ids": prompt_ids, "answers": rec["answers"]}

        answer = random.choice(rec["answers"])
        target = prompt + answer + "</s_answer>" + tok.eos_token
        input_ids = tok(
            target, add_special_tokens=False, max_length=self.max_length,
            padding="max_length", truncation=True, return_tensors="pt",
        ).input_ids[0]
        labels = input_ids.clone()
        labels[labels == tok.pad_token_id] = -100
        prompt_len = len(tok(prompt, add_special_tokens=False).input_ids)
        labels[:prompt_len] = -100
        return {"pixel_values": pixel_values, "input_ids": input_ids, "labels": labels}


def eval_collate(batch):
    assert len(batch) == 1, "generation is done one page at a time"
    item = batch[0]
    return {
        "pixel_values": item["pixel_values"].unsqueeze(0),
        "prompt_ids": item["prompt_ids"].unsqueeze(0),
        "answers": item["answers"],
    }


@torch.no_grad()
def evaluate(model, loader, processor, device, max_length, amp_dtype):
    model.eval()
    tok = processor.tokenizer
    scores = []
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        prompt_ids = batch["prompt_ids"].to(device)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model.module.generate(
                pixel_values,
                decoder_input_ids=prompt_ids,
                max_length=max_length,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                use_cache=True,
                num_beams=1,
                bad_words_ids=[[tok.unk_token_id]],
            )
        seq = tok.batch_decode(out)[0]
        seq = seq.replace(tok.eos_token, "").replace(tok.pad_token, "")
        m = re.search(r"<s_answer>(.*?)(</s_answer>|$)", seq)
        pred = m.group(1).strip() if m else ""
        scores.append(anls(pred, batch["answers"]))
    model.train()
    return sum(scores) / max(len(scores), 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.image_size[0], "width": args.image_size[1]}
    processor.image_processor.do_align_long_axis = False
    processor.tokenizer.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS})

    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained)
    model.config.encoder.image_size = args.image_size
    model.config.decoder.max_length = args.max_length
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK_TOKEN)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = DocVQADataset(args.data_dir, "train", processor, args.max_length)
    val_ds = DocVQADataset(args.data_dir, "val", processor, args.max_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True,
    )
    val_loader = DataLoader(
        val_ds, batch_size=1, sampler=val_sampler, num_workers=2, collate_fn=eval_collate,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    amp_dtype = torch.bfloat16 if args.bf16 else None

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("train=%d val=%d world=%d steps=%d", len(train_ds), len(val_ds), world_size, total_steps)

    best_anls, step = -1.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                out = model(pixel_values=pixel_values, decoder_input_ids=input_ids[:, :-1], labels=labels[:, 1:])
            loss = out.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.log_every == 0 and rank == 0:
                logger.info(
                    "epoch %d step %d loss %.4f lr %.2e (%.1fs)",
                    epoch, step, loss.item(), scheduler.get_last_lr()[0], time.time() - t0,
                )
                t0 = time.time()

        val_anls = evaluate(model, val_loader, processor, device, args.max_length, amp_dtype)
        if rank == 0:
            logger.info("epoch %d val ANLS %.4f", epoch, val_anls)
            if val_anls > best_anls:
                best_anls = val_anls
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best", "metrics.json"), "w") as f:
                    json.dump({"epoch": epoch, "anls": best_anls}, f)
        dist.barrier()

    if rank == 0:
        logger.info("done, best val ANLS %.4f", best_anls)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
