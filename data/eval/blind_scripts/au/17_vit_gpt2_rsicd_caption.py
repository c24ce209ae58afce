"""Remote-sensing image captioning (RSICD / UCM-captions format) with a ViT encoder and a
GPT-2 decoder (VisionEncoderDecoderModel), BLEU-4 / CIDEr on a held-out split.

The dataset ships as one JSON of images with five sentences each; 10% of the images are
held out for validation.

    torchrun --nproc_per_node=4 17_vit_gpt2_rsicd_caption.py --ann /data/RSICD/dataset_rsicd.json \
        --images /data/RSICD/RSICD_images --out runs/rsicd_vit_gpt2
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, ViTImageProcessor, VisionEncoderDecoderModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--encoder", default="google/vit-base-patch16-224-in21k")
    p.add_argument("--decoder", default="gpt2")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CaptionPairs(Dataset):
    """One sample per (image, sentence) for training; one per image (with all refs) for eval."""

    def __init__(self, images, image_dir, processor, tokenizer, max_len, train):
        self.image_dir, self.processor, self.tok, self.max_len, self.train = image_dir, processor, tokenizer, max_len, train
        if train:
            self.samples = [(im["filename"], s["raw"]) for im in images for s in im["sentences"]]
        else:
            self.samples = [(im["filename"], [s["raw"] for s in im["sentences"]]) for im in images]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fn, cap = self.samples[i]
        pix = self.processor(Image.open(os.path.join(self.image_dir, fn)).convert("RGB"),
                             return_tensors="pt").pixel_values[0]
        if not self.train:
            return pix, i
        enc = self.tok(cap.strip() + self.tok.eos_token, max_length=self.max_len, truncation=True,
                       padding="max_length", return_tensors="pt")
        labels = enc.input_ids[0].masked_fill(enc.attention_mask[0] == 0, -100)
        return pix, labels


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different augmentation / dropout streams per rank
    seed_everything(args.seed + rank)

    processor = ViTImageProcessor.from_pretrained(args.encoder)
    tokenizer = AutoTokenizer.from_pretrained(args.decoder)
    tokenizer.pad_token = tokenizer.eos_token

    images = json.load(open(args.ann))["images"]
    random.shuffle(images)
    n_val = int(len(images) * args.val_frac)
    val_images, train_images = images[:n_val], images[n_val:]

    train_ds = CaptionPairs(train_images, args.images, processor, tokenizer, args.max_len, train=True)
    val_ds = CaptionPairs(val_images, args.images, processor, tokenizer, args.max_len, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    model = VisionEncoderDecoderModel.from_encoder_decoder_pretrained(args.encoder, args.decoder)
    model.config.decoder_start_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.05)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for it, (pix, labels) in enumerate(train_loader):
            pix, labels = pix.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(pixel_values=pix, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        model.eval()
        local = {}
        with torch.no_grad():
            for pix, idx in val_loader:
                out = model.generate(pixel_values=pix.to(device), max_length=args.max_len, num_beams=3)
                for i, c in zip(idx.tolist(), tokenizer.batch_decode(out, skip_special_tokens=True)):
                    local[i] = c.strip()
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = {}
            for p in parts:
                preds.update(p)
            gts = {i: val_ds.samples[i][1] for i in preds}
            res = {i: [preds[i]] for i in preds}
            bleu, _ = Bleu(4).compute_score(gts, res)
            cider, _ = Cider().compute_score(gts, res)
            print(f"epoch {epoch} BLEU-4 {bleu[3]:.4f} CIDEr {cider:.4f}", flush=True)
            if cider > best:
                best = cider
                os.makedirs(args.out, exist_ok=True)
                model.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
