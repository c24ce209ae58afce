#!/usr/bin/env python
"""OCR-free invoice parsing with Donut; experiments tracked in W&B (project docai-invoices).

Targets are produced by the labelling export as flat JSON:
    {"invoice_number": "...", "invoice_date": "...", "vendor_name": "...", "total_amount": "...",
     "currency": "...", "line_items": [{"description": "...", "quantity": "...", "amount": "..."}]}

    torchrun --nproc_per_node=8 13_donut_invoice_wandb.py --run_name donut-inv-1280 --epochs 40
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

FIELDS = ["invoice_number", "invoice_date", "vendor_name", "total_amount", "currency", "line_items"]
ITEM_FIELDS = ["description", "quantity", "amount"]
PROMPT = "<s_invoice>"


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/invoices/donut_v3")
    ap.add_argument("--run_name", default="donut-invoice")
    ap.add_argument("--base", default="naver-clova-ix/donut-base")
    ap.add_argument("--height", type=int, default=1280)
    ap.add_argument("--width", type=int, default=960)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--ckpt_dir", default="/checkpoints/donut_invoice")
    return ap.parse_args()


def to_sequence(obj):
    if isinstance(obj, dict):
        return "".join(f"<s_{k}>{to_sequence(obj[k])}</s_{k}>" for k in obj if obj[k] not in (None, ""))
    if isinstance(obj, list):
        return "<sep/>".join(to_sequence(x) for x in obj)
    return str(obj)


def special_tokens():
    toks = [PROMPT, "<sep/>"]
    for k in FIELDS + ITEM_FIELDS:
        toks += [f"<s_{k}>", f"</s_{k}>"]
    return toks


class InvoiceDonut(Dataset):
    def __init__(self, split_dir, processor, max_len, train):
        with open(os.path.join(split_dir, "metadata.jsonl")) as fh:
            self.rows = [json.loads(l) for l in fh]
        self.split_dir = split_dir
        self.processor = processor
        self.max_len = max_len
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        img = Image.open(os.path.join(self.split_dir, row["file_name"])).convert("RGB")
        pixel_values = self.processor(img, random_padding=self.train, return_tensors="pt").pixel_values[0]
        target = PROMPT + to_sequence(json.loads(row["ground_truth"])) + self.processor.tokenizer.eos_token
        ids = self.processor.tokenizer(target, add_special_tokens=False, max_length=self.max_len,
                                       padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": labels, "gt": row["ground_truth"]}


def header_fields(seq):
    out = {}
    for k in FIELDS[:-1]:
        m = re.search(rf"<s_{k}>(.*?)</s_{k}>", seq)
        if m:
            out[k] = m.group(1).strip()
    return out


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="docai-invoices", name=args.run_name, config=vars(args),
               tags=["donut", f"{args.height}x{args.width}"])

    processor = DonutProcessor.from_pretrained(args.base)
    processor.image_processor.size = {"height": args.height, "width": args.width}
    processor.image_processor.do_align_long_axis = False
    processor.tokenizer.add_special_tokens({"additional_special_tokens": special_tokens()})

    model = VisionEncoderDecoderModel.from_pretrained(args.base)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.encoder.image_size = [args.height, args.width]
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(PROMPT)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_ds = InvoiceDonut(os.path.join(args.data, "train"), processor, args.max_len, train=True)
    val_ds = InvoiceDonut(os.path.join(args.data, "validation"), processor, args.max_len, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)
    prompt_ids = processor.tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids.to(device)

    step = 0
    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                             labels=batch["labels"].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        # header-field exact match on validation (line items are scored offline)
        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_dl:
                out = model.module.generate(batch["pixel_values"].to(device), decoder_input_ids=prompt_ids,
                                            max_length=args.max_len, pad_token_id=processor.tokenizer.pad_token_id,
                                            eos_token_id=processor.tokenizer.eos_token_id,
                                            bad_words_ids=[[processor.tokenizer.unk_token_id]])
                pred = header_fields(processor.tokenizer.decode(out[0]))
                gold = {k: str(v).strip() for k, v in json.loads(batch["gt"][0]).items()
                        if k in FIELDS[:-1] and v not in (None, "")}
                hits[0] += sum(pred.get(k) == v for k, v in gold.items())
                hits[1] += len(gold)
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1].clamp(min=1)).item()
        wandb.log({"val/header_field_acc": acc, "epoch": epoch}, step=step)

        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(args.ckpt_dir, "best"))
                processor.save_pretrained(os.path.join(args.ckpt_dir, "best"))
            print(f"epoch {epoch} header field acc {acc:.4f} (best {best_acc:.4f})", flush=True)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
