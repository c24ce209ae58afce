"""Continue training Nougat (PDF page image -> markdown) on our scientific-report corpus
with DeepSpeed ZeRO-3.

Each jsonl line: {"pdf": "reports/2019/ab12.pdf", "page": 3, "markdown": "..."}

    deepspeed --num_gpus=8 14_nougat_zero3_deepspeed.py --train_jsonl data/train.jsonl --val_jsonl data/val.jsonl
"""
import argparse
import json
import os
import time

import deepspeed
import pypdfium2 as pdfium
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import NougatProcessor, VisionEncoderDecoderModel


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_jsonl", required=True)
    ap.add_argument("--val_jsonl", required=True)
    ap.add_argument("--pdf_root", default="/data/pdfs")
    ap.add_argument("--model", default="facebook/nougat-base")
    ap.add_argument("--output_dir", default="runs/nougat_reports")
    ap.add_argument("--dpi", type=int, default=96)
    ap.add_argument("--max_length", type=int, default=3584)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class PdfPages(Dataset):
    def __init__(self, jsonl, pdf_root, processor, dpi, max_length):
        with open(jsonl) as f:
            self.rows = [json.loads(l) for l in f]
        self.pdf_root = pdf_root
        self.processor = processor
        self.scale = dpi / 72
        self.max_length = max_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pdf = pdfium.PdfDocument(os.path.join(self.pdf_root, r["pdf"]))
        try:
            image = pdf[r["page"]].render(scale=self.scale).to_pil().convert("RGB")
        finally:
            pdf.close()
        pixel_values = self.processor(image, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(
            r["markdown"], max_length=self.max_length, truncation=True, padding="max_length",
            return_tensors="pt",
        ).input_ids[0]
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return pixel_values, labels


@torch.no_grad()
def validate(engine, loader):
    engine.eval()
    total = torch.zeros(2, device=engine.device)
    for pixel_values, labels in loader:
        pixel_values = pixel_values.to(engine.device, dtype=torch.bfloat16)
        labels = labels.to(engine.device)
        loss = engine(pixel_values=pixel_values, labels=labels).loss
        total[0] += loss.float() * labels.size(0)
        total[1] += labels.size(0)
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    processor = NougatProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder.max_length = args.max_length
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    train_ds = PdfPages(args.train_jsonl, args.pdf_root, processor, args.dpi, args.max_length)
    val_ds = PdfPages(args.val_jsonl, args.pdf_root, processor, args.dpi, args.max_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    total_steps = (len(train_loader) // args.grad_accum) * args.epochs
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.05}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                       "warmup_num_steps": args.warmup, "total_num_steps": total_steps},
        },
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    ckpt_dir = os.path.join(args.output_dir, "ds_ckpt")
    start_epoch, best_val = 0, float("inf")
    if os.path.isdir(ckpt_dir):
        _, client_state = engine.load_checkpoint(ckpt_dir)
        if client_state:
            start_epoch = client_state["epoch"] + (1 if client_state["epoch_done"] else 0)
            best_val = client_state.get("best_val", best_val)
            if rank == 0:
                print(f"resumed from step {engine.global_steps}, epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (pixel_values, labels) in enumerate(train_loader):
            pixel_values = pixel_values.to(engine.device, dtype=torch.bfloat16, non_blocking=True)
            labels = labels.to(engine.device, non_blocking=True)
            loss = engine(pixel_values=pixel_values, labels=labels).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(ckpt_dir, client_state={"epoch": epoch, "epoch_done": False,
                                                               "best_val": best_val})
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} micro-step {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        val_loss = validate(engine, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} (world {world})", flush=True)
        improved = val_loss < best_val
        best_val = min(best_val, val_loss)
        engine.save_checkpoint(ckpt_dir, client_state={"epoch": epoch, "epoch_done": True, "best_val": best_val})
        if improved and rank == 0:
            export_dir = os.path.join(args.output_dir, "best_hf")
            engine.module.save_pretrained(export_dir, safe_serialization=True)
            processor.save_pretrained(export_dir)
        dist.barrier()

    if rank == 0:
        print(f"done, best val loss {best_val:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
