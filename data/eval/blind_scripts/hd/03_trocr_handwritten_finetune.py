# Fine-tune TrOCR (base, handwritten) on our scanned-forms line crops.
#
#   torchrun --nproc_per_node=4 03_trocr_handwritten_finetune.py \
#       --train-csv data/forms/train.csv --val-csv data/forms/val.csv --img-dir data/forms/crops
#
# CSV format: file_name,text
import argparse
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from evaluate import load as load_metric
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/trocr-base-handwritten")
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--img-dir", required=True)
    p.add_argument("--out-dir", default="output/trocr_forms")
    p.add_argument("--per-device-batch", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--max-target-len", type=int, default=96)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--bf16", action="store_true")
    return p.parse_args()


class FormLines(Dataset):
    def __init__(self, csv_path, img_dir, processor, max_len):
        self.df = pd.read_csv(csv_path, keep_default_na=False)
        self.img_dir = img_dir
        self.processor = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        image = Image.open(os.path.join(self.img_dir, row["file_name"])).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values.squeeze(0)
        labels = self.processor.tokenizer(row["text"], padding="max_length", max_length=self.max_len,
                                          truncation=True).input_ids
        labels = [l if l != self.processor.tokenizer.pad_token_id else -100 for l in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "text": row["text"]}


def collate(batch):
    return {
        "pixel_values": torch.stack([b["pixel_values"] for b in batch]),
        "labels": torch.stack([b["labels"] for b in batch]),
        "text": [b["text"] for b in batch],
    }


def is_main():
    return dist.get_rank() == 0


@torch.no_grad()
def validate(model, processor, loader, device, cer_metric, args, amp_dtype):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.bf16):
            generated_ids = model.generate(pixel_values, num_beams=args.num_beams,
                                           max_new_tokens=args.max_target_len)
        preds.extend(processor.batch_decode(generated_ids, skip_special_tokens=True))
        refs.extend(batch["text"])
    # char-level error counts so they can be summed across ranks
    errs = sum(cer_metric.compute(predictions=[p], references=[r]) * max(len(r), 1) for p, r in zip(preds, refs))
    chars = sum(max(len(r), 1) for r in refs)
    t = torch.tensor([errs, chars], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    world_size = dist.get_world_size()
    torch.manual_seed(0)

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    model.to(device)

    train_ds = FormLines(args.train_csv, args.img_dir, processor, args.max_target_len)
    val_ds = FormLines(args.val_csv, args.img_dir, processor, args.max_target_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_idx = list(range(dist.get_rank(), len(val_ds), world_size))
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              num_workers=6, pin_memory=True, collate_fn=collate)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=24,
                            num_workers=4, collate_fn=collate)

    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    amp_dtype = torch.bfloat16
    cer_metric = load_metric("cer")

    best = 1.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            last_micro = (i + 1) % args.grad_accum == 0 or (i + 1) == len(train_loader)
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=args.bf16):
                    loss = model(pixel_values=pixel_values, labels=labels).loss / args.grad_accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if is_main() and global_step % 50 == 0:
                    print(f"epoch {epoch} step {global_step}/{total_steps} "
                          f"loss {loss.item() * args.grad_accum:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        cer = validate(model, processor, val_loader, device, cer_metric, args, amp_dtype)
        if is_main():
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, val CER {cer:.4f}", flush=True)
            if cer < best:
                best = cer
                model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                processor.save_pretrained(os.path.join(args.out_dir, "best"))
        dist.barrier()

    if is_main():
        model.module.save_pretrained(os.path.join(args.out_dir, "final"))
        processor.save_pretrained(os.path.join(args.out_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
