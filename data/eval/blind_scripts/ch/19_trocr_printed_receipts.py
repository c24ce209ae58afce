"""Fine-tune TrOCR-base-printed on receipt text lines (SROIE crops + in-house scans).

    torchrun --nproc_per_node=4 19_trocr_printed_receipts.py --data-dir data/receipt_lines --accum 4
    # resume after preemption:
    torchrun --nproc_per_node=4 19_trocr_printed_receipts.py --data-dir data/receipt_lines --accum 4 \
        --resume runs/trocr_receipts/state.pt
"""
import argparse
import contextlib
import csv
import logging
import os
import time

import editdistance
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logger = logging.getLogger("trocr")


class ReceiptLines(Dataset):
    def __init__(self, csv_file, image_dir, processor, max_len=64):
        with open(csv_file, newline="", encoding="utf-8") as f:
            self.rows = [(r["image"], r["text"]) for r in csv.DictReader(f)]
        self.image_dir, self.processor, self.max_len = image_dir, processor, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        name, text = self.rows[i]
        image = Image.open(os.path.join(self.image_dir, name)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values[0]
        ids = self.processor.tokenizer(text, max_length=self.max_len, truncation=True, padding="max_length").input_ids
        labels = torch.tensor(ids)
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": labels, "index": i}


@torch.no_grad()
def evaluate(model, loader, processor, device, world):
    model.eval()
    local = []
    for batch in loader:
        gen = model.module.generate(batch["pixel_values"].to(device, non_blocking=True), max_new_tokens=64)
        texts = processor.batch_decode(gen, skip_special_tokens=True)
        local += list(zip(batch["index"].tolist(), texts))
    model.train()
    # predictions are strings of different lengths: gather them as Python objects
    shards = [None] * world
    dist.all_gather_object(shards, local)
    preds = {}
    for shard in shards:
        preds.update(shard)  # indices duplicated by the sampler's padding collapse here
    rows = loader.dataset.rows
    edits = sum(editdistance.eval(preds[i], rows[i][1]) for i in preds)
    chars = sum(len(rows[i][1]) for i in preds)
    exact = sum(preds[i] == rows[i][1] for i in preds)
    return edits / max(chars, 1), exact / max(len(preds), 1), len(preds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--model", default="microsoft/trocr-base-printed")
    ap.add_argument("--out", default="runs/trocr_receipts")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    tok = processor.tokenizer
    model.config.decoder_start_token_id = tok.cls_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.sep_token_id
    model.generation_config.decoder_start_token_id = tok.cls_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.sep_token_id
    # the decoder only reads the encoder's token states; freeze the (unused) ViT pooler so DDP
    # does not wait for gradients that never come
    for p in model.encoder.pooler.parameters():
        p.requires_grad_(False)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = ReceiptLines(os.path.join(args.data_dir, "train.csv"), os.path.join(args.data_dir, "images"), processor)
    val_ds = ReceiptLines(os.path.join(args.data_dir, "val.csv"), os.path.join(args.data_dir, "images"), processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    updates = args.epochs * (len(train_dl) // args.accum)
    sched = get_cosine_schedule_with_warmup(optim, int(0.05 * updates), updates)

    start_epoch, best_cer = 0, float("inf")
    if args.resume and os.path.exists(args.resume):
        st = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(st["model"])
        optim.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        start_epoch, best_cer = st["epoch"] + 1, st["best_cer"]
        logger.info("resumed at epoch %d (best CER %.4f)", start_epoch, best_cer)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        n_micro = (len(train_dl) // args.accum) * args.accum  # drop the ragged tail of micro-batches
        for i, batch in enumerate(train_dl):
            if i >= n_micro:
                break
            last_micro = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if last_micro else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                                 labels=batch["labels"].to(device, non_blocking=True)).loss
                (loss / args.accum).backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            if i % 200 == 0:
                logger.info("epoch %d micro-step %d/%d loss %.4f", epoch, i, n_micro, loss.item())

        cer, acc, n = evaluate(model, val_dl, processor, device, world)
        logger.info("epoch %d: CER %.4f line-acc %.4f on %d lines (%.0fs)", epoch, cer, acc, n, time.time() - t0)
        if rank == 0:
            if cer < best_cer:
                best_cer = cer
                model.module.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_cer": best_cer}, os.path.join(args.out, "state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
