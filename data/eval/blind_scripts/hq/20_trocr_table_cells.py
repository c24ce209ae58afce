"""Fine-tune TrOCR on text crops of table cells (numbers, units, short headers) cut out of
financial statements. Reports character error rate (CER) on the held-out crops.

    torchrun --nproc_per_node=4 20_trocr_table_cells.py --train_tsv cells/train.tsv --val_tsv cells/val.tsv
"""
import argparse
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
from torchvision import transforms
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

log = logging.getLogger("trocr_cells")


def parse_args():
    p = argparse.ArgumentParser(description="TrOCR fine-tuning on table cell crops")
    p.add_argument("--train_tsv", required=True)
    p.add_argument("--val_tsv", required=True)
    p.add_argument("--crop_root", default="/data/table_cells")
    p.add_argument("--model", default="microsoft/trocr-base-printed")
    p.add_argument("--output_dir", default="trocr_cells_ft")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max_target_len", type=int, default=48)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class CellCrops(Dataset):
    def __init__(self, tsv, root, processor, max_len, augment=False):
        self.rows = []
        with open(tsv, encoding="utf-8") as f:
            for line in f:
                path, text = line.rstrip("\n").split("\t", 1)
                self.rows.append((path, text))
        self.root, self.processor, self.max_len = root, processor, max_len
        self.aug = transforms.Compose([
            transforms.RandomApply([transforms.GaussianBlur(3, sigma=(0.1, 0.8))], p=0.3),
            transforms.RandomAffine(degrees=1, shear=2, fill=255),
        ]) if augment else None

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        if self.aug is not None:
            img = self.aug(img)
        pixel_values = self.processor(images=img, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(text, padding="max_length", max_length=self.max_len,
                                          truncation=True).input_ids
        labels = [t if t != self.processor.tokenizer.pad_token_id else -100 for t in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "idx": i}


@torch.no_grad()
def compute_cer(model, loader, dataset, processor, device):
    model.eval()
    errs = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        generated = model.module.generate(batch["pixel_values"].to(device), max_new_tokens=dataset.max_len,
                                          num_beams=1)
        preds = processor.batch_decode(generated, skip_special_tokens=True)
        for pred, i in zip(preds, batch["idx"].tolist()):
            gold = dataset.rows[i][1]
            errs[0] += editdistance.eval(pred.strip(), gold)
            errs[1] += max(len(gold), 1)
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    # the ViT encoder comes with a freshly initialised pooler that the decoder never reads
    model = DDP(model.to(device), device_ids=[args.local_rank], output_device=args.local_rank,
                find_unused_parameters=True)

    train_ds = CellCrops(args.train_tsv, args.crop_root, processor, args.max_target_len, augment=True)
    val_ds = CellCrops(args.val_tsv, args.crop_root, processor, args.max_target_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.num_workers)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, total // 20, total)
    scaler = torch.cuda.amp.GradScaler()

    best_cer = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=pixel_values, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.item()
            if step % 100 == 99:
                log.info("epoch %d step %d loss %.4f (%.1f crops/s)", epoch, step + 1, running / 100,
                         100 * args.batch_size * world_size / (time.time() - t0))
                running, t0 = 0.0, time.time()

        cer = compute_cer(model, val_loader, val_ds, processor, device)
        log.info("epoch %d val CER %.4f", epoch, cer)
        if rank == 0 and cer < best_cer:
            best_cer = cer
            model.module.save_pretrained(args.output_dir)
            processor.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
