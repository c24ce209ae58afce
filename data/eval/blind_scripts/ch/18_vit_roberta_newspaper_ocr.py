"""Printed-text line OCR: ViT-384 encoder + RoBERTa decoder (TrOCR recipe, initialised from
public checkpoints instead of the TrOCR weights), trained on historical-newspaper line crops.

    torchrun --nproc_per_node=8 18_vit_roberta_newspaper_ocr.py --data data/newspapers --bs 24
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoTokenizer, VisionEncoderDecoderModel, ViTImageProcessor,
                          get_linear_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with train.jsonl / val.jsonl / images/")
    p.add_argument("--encoder", default="google/vit-base-patch16-384")
    p.add_argument("--decoder", default="FacebookAI/roberta-base")
    p.add_argument("--out", default="runs/vit_roberta_news")
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-len", type=int, default=96)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--grad-checkpointing", action="store_true", default=True)
    return p.parse_args()


class NewspaperLines(Dataset):
    def __init__(self, root, split, image_processor, tokenizer, max_len):
        with open(os.path.join(root, f"{split}.jsonl"), encoding="utf-8") as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.ip, self.tok, self.max_len = root, image_processor, tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, "images", r["image"])).convert("RGB")
        pv = self.ip(img, return_tensors="pt").pixel_values[0]
        ids = self.tok(r["text"], max_length=self.max_len, truncation=True, padding="max_length").input_ids
        labels = torch.tensor([t if t != self.tok.pad_token_id else -100 for t in ids])
        return {"pixel_values": pv, "labels": labels, "text": r["text"]}


def collate(batch):
    return {"pixel_values": torch.stack([b["pixel_values"] for b in batch]),
            "labels": torch.stack([b["labels"] for b in batch]),
            "text": [b["text"] for b in batch]}


@torch.no_grad()
def evaluate(model, loader, tok, device, max_len):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in loader:
        out = model.module.generate(batch["pixel_values"].to(device), max_new_tokens=max_len, num_beams=1)
        hyps = tok.batch_decode(out, skip_special_tokens=True)
        for h, ref in zip(hyps, batch["text"]):
            s[0] += editdistance.eval(h, ref)
            s[1] += len(ref)
            s[2] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    image_processor = ViTImageProcessor.from_pretrained(args.encoder)
    tok = AutoTokenizer.from_pretrained(args.decoder)
    model = VisionEncoderDecoderModel.from_encoder_decoder_pretrained(args.encoder, args.decoder)
    model.config.decoder_start_token_id = tok.cls_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.sep_token_id
    model.generation_config.decoder_start_token_id = tok.cls_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.sep_token_id
    model.config.use_cache = False
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()  # 384px ViT activations do not fit at bs 24 otherwise
    model.to(device)
    # the ViT pooler output is not consumed by the decoder, so its weights never get gradients
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_ds = NewspaperLines(args.data, "train", image_processor, tok, args.max_len)
    val_ds = NewspaperLines(args.data, "val", image_processor, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=48, collate_fn=collate,
                        num_workers=4)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(optim, num_warmup_steps=int(0.05 * total), num_training_steps=total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train lines, {len(val_ds)} val lines, {world} GPUs", flush=True)
    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, batch in enumerate(train_dl):
            pv = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pv, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        cer = evaluate(model, val_dl, tok, device, args.max_len)
        if rank == 0:
            print(f"epoch {epoch} val CER {cer:.4f} ({time.time() - tic:.0f}s)", flush=True)
            if cer < best:
                best = cer
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
                image_processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
