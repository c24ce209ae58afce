"""ViT encoder + GPT-2 decoder captioner (HF VisionEncoderDecoderModel) trained on COCO + CC3M captions.

Captions are tokenized once and cached next to the annotation file so later runs start fast.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import (AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel,
                          get_linear_schedule_with_warmup)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--annotations", nargs="+", required=True,
                    help="jsonl files with {image, caption}, image paths relative to --image-root")
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--encoder", default="google/vit-base-patch16-224-in21k")
    ap.add_argument("--decoder", default="gpt2")
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output-dir", default="/mnt/shared/captioner/vit_gpt2")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def cache_path_for(ann_path, tokenizer_name, max_len):
    key = hashlib.md5(f"{os.path.abspath(ann_path)}|{tokenizer_name}|{max_len}".encode()).hexdigest()[:10]
    return os.path.splitext(ann_path)[0] + f".tok_{key}.pt"


def load_or_tokenize(ann_path, tokenizer, tokenizer_name, max_len):
    cache = cache_path_for(ann_path, tokenizer_name, max_len)
    if os.path.exists(cache):
        return torch.load(cache)
    images, captions = [], []
    with open(ann_path) as f:
        for line in f:
            rec = json.loads(line)
            images.append(rec["image"])
            captions.append(rec["caption"].strip())
    ids = []
    for s in tqdm(range(0, len(captions), 4096), desc=f"tokenizing {os.path.basename(ann_path)}"):
        enc = tokenizer([c + tokenizer.eos_token for c in captions[s:s + 4096]], truncation=True,
                        max_length=max_len)
        ids.extend(enc["input_ids"])
    data = {"images": images, "input_ids": ids}
    torch.save(data, cache)
    return data


class CaptionDataset(Dataset):
    def __init__(self, cached_parts, image_root, processor):
        self.images, self.input_ids = [], []
        for part in cached_parts:
            self.images.extend(part["images"])
            self.input_ids.extend(part["input_ids"])
        self.image_root = image_root
        self.processor = processor

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_root, self.images[i])).convert("RGB")
        pixel_values = self.processor(img, return_tensors="pt").pixel_values[0]
        return pixel_values, torch.tensor(self.input_ids[i], dtype=torch.long)


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        pixels, ids = zip(*batch)
        max_len = max(len(x) for x in ids)
        labels = torch.full((len(ids), max_len), -100, dtype=torch.long)
        for i, x in enumerate(ids):
            labels[i, :len(x)] = x
        return torch.stack(pixels), labels


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.decoder)
    tokenizer.pad_token = tokenizer.eos_token
    processor = AutoImageProcessor.from_pretrained(args.encoder)

    parts = [load_or_tokenize(p, tokenizer, args.decoder, args.max_len) for p in args.annotations]
    dataset = CaptionDataset(parts, args.image_root, processor)

    # the ViT pooler is not used by the decoder, so don't create it
    model = VisionEncoderDecoderModel.from_encoder_decoder_pretrained(
        args.encoder, args.decoder, encoder_add_pooling_layer=False)
    model.config.decoder_start_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=PadCollator(tokenizer.pad_token_id), pin_memory=True, drop_last=True)

    no_decay = ("bias", "LayerNorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, total)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(dataset)} captions, {world} GPUs, {len(loader)} steps/epoch", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for it, (pixels, labels) in enumerate(loader):
            pixels = pixels.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=pixels, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if it % 200 == 0 and it > 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    print(f"epoch {epoch} step {it}/{len(loader)} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / it:.3f}s/it", flush=True)
                loss_acc.zero_()

        if rank == 0:
            out = os.path.join(args.output_dir, f"epoch{epoch}")
            model.module.save_pretrained(out)
            tokenizer.save_pretrained(out)
            processor.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
