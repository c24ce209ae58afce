"""Fine-tune TrOCR (VisionEncoderDecoder) on rendered LaTeX formulas with plain DDP.

    torchrun --nproc_per_node=4 09_mathpix_like_ocr.py --train data/formulas/train.csv \
        --val data/formulas/val.csv --wandb_project formula-ocr
"""
import argparse
import csv
import os

import sacrebleu
import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--image_root", default="data/formulas/images")
    p.add_argument("--model", default="microsoft/trocr-small-printed")
    p.add_argument("--output_dir", default="out/trocr-latex")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--per_device_batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--max_target_length", type=int, default=256)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--wandb_project", default="formula-ocr")
    p.add_argument("--run_name", default=None)
    return p.parse_args()


class FormulaCSV(Dataset):
    def __init__(self, csv_path, image_root, processor, max_len):
        with open(csv_path, newline="", encoding="utf-8") as f:
            self.rows = [(r["image"], r["latex"]) for r in csv.DictReader(f)]
        self.image_root, self.processor, self.max_len = image_root, processor, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        name, latex = self.rows[i]
        image = Image.open(os.path.join(self.image_root, name)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(latex, max_length=self.max_len, truncation=True).input_ids
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "latex": latex}


def make_collate(pad_id):
    def collate(batch):
        pix = torch.stack([b["pixel_values"] for b in batch])
        labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True,
                                                 padding_value=pad_id)
        labels[labels == pad_id] = -100
        return pix, labels, [b["latex"] for b in batch]
    return collate


def normalise(s):
    return " ".join(s.split())


@torch.no_grad()
def evaluate(model, loader, processor, args, device):
    model.eval()
    preds, refs = [], []
    for pix, _, latex in loader:
        out = model.module.generate(pix.to(device), num_beams=args.num_beams,
                                    max_length=args.max_target_length, early_stopping=True)
        preds += [normalise(t) for t in processor.batch_decode(out, skip_special_tokens=True)]
        refs += [normalise(t) for t in latex]
    world = dist.get_world_size()
    all_preds, all_refs = [None] * world, [None] * world
    dist.all_gather_object(all_preds, preds)
    dist.all_gather_object(all_refs, refs)
    preds = [p for part in all_preds for p in part]
    refs = [r for part in all_refs for r in part]
    model.train()
    bleu = sacrebleu.corpus_bleu(preds, [refs]).score
    em = sum(p == r for p, r in zip(preds, refs)) / len(refs)
    return bleu, em


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config={**vars(args), "world_size": world})

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    tok = processor.tokenizer
    model.config.decoder_start_token_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    collate = make_collate(tok.pad_token_id)
    train_ds = FormulaCSV(args.train, args.image_root, processor, args.max_target_length)
    val_ds = FormulaCSV(args.val, args.image_root, processor, args.max_target_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=6, pin_memory=True)
    # every rank decodes its own strided slice of the validation set (no padded duplicates)
    val_part = Subset(val_ds, range(rank, len(val_ds), world))
    val_dl = DataLoader(val_part, batch_size=args.per_device_batch_size, shuffle=False,
                        collate_fn=collate, num_workers=4)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    step, best = 0, -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for pix, labels, _ in train_dl:
            pix, labels = pix.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pix, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        bleu, em = evaluate(model, val_dl, processor, args, device)
        wandb.log({"val/bleu": bleu, "val/exact_match": em}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: BLEU {bleu:.2f} EM {em:.4f}", flush=True)
            if bleu > best:
                best = bleu
                model.module.save_pretrained(args.output_dir)
                processor.save_pretrained(args.output_dir)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
