"""ViT encoder + GPT-2 decoder image captioning (teacher forcing), COCO Karpathy split.
Beam search + BLEU/CIDEr on val after every epoch.

    torchrun --nproc_per_node=8 11_vit_gpt2_captioner.py --coco /data/coco --save-dir /nfs/exp/vitgpt2
"""
import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import (AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel,
                          get_linear_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--coco", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--encoder", default="google/vit-base-patch16-224-in21k")
    p.add_argument("--decoder", default="gpt2")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Captions(Dataset):
    def __init__(self, ann_path, root, split):
        data = json.load(open(ann_path))
        self.root = root
        if split == "train":
            self.items = [(im["filepath"] + "/" + im["filename"], s["raw"], im["cocoid"])
                          for im in data["images"] if im["split"] in ("train", "restval")
                          for s in im["sentences"]]
        else:
            self.items = [(im["filepath"] + "/" + im["filename"], [s["raw"] for s in im["sentences"]], im["cocoid"])
                          for im in data["images"] if im["split"] == split]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, cap, cid = self.items[i]
        return Image.open(os.path.join(self.root, path)).convert("RGB"), cap, cid


def save_checkpoint(model, optimizer, scheduler, epoch, best, path, is_best):
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "best_cider": best,
    }
    torch.save(state, os.path.join(path, "checkpoint.pth"))
    if is_best:
        shutil.copyfile(os.path.join(path, "checkpoint.pth"), os.path.join(path, "model_best.pth"))


@torch.no_grad()
def evaluate(model, loader, tokenizer, args, device, rank):
    model.eval()
    preds, refs = {}, {}
    for pixel_values, caps, cids in tqdm(loader, disable=rank != 0, desc="eval"):
        out = model.module.generate(pixel_values.to(device), num_beams=args.beams, max_length=args.max_len,
                                    early_stopping=True)
        for cid, ref, o in zip(cids, caps, tokenizer.batch_decode(out, skip_special_tokens=True)):
            preds[cid] = [o.strip()]
            refs[cid] = ref
    world = dist.get_world_size()
    all_preds, all_refs = [None] * world, [None] * world
    dist.all_gather_object(all_preds, preds)
    dist.all_gather_object(all_refs, refs)
    preds = {k: v for d in all_preds for k, v in d.items()}
    refs = {k: v for d in all_refs for k, v in d.items()}
    cider, _ = Cider().compute_score(refs, preds)
    bleu, _ = Bleu(4).compute_score(refs, preds)
    model.train()
    return cider, bleu[3]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.decoder)
    tokenizer.pad_token = tokenizer.eos_token
    image_processor = AutoImageProcessor.from_pretrained(args.encoder)
    model = VisionEncoderDecoderModel.from_encoder_decoder_pretrained(args.encoder, args.decoder)
    model.config.decoder_start_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.encoder.pooler = None  # decoder cross-attends to the patch tokens only
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    def collate_train(batch):
        imgs, caps, _ = zip(*batch)
        pix = image_processor(list(imgs), return_tensors="pt").pixel_values
        enc = tokenizer([c + tokenizer.eos_token for c in caps], padding=True, truncation=True,
                        max_length=args.max_len, return_tensors="pt")
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        return pix, labels

    def collate_eval(batch):
        imgs, caps, cids = zip(*batch)
        return image_processor(list(imgs), return_tensors="pt").pixel_values, list(caps), list(cids)

    ann = os.path.join(args.coco, "dataset_coco.json")
    train_ds = Captions(ann, args.coco, "train")
    val_ds = Captions(ann, args.coco, "val")
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True, collate_fn=collate_train)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate_eval)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 500, args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.save_dir, "checkpoint.pth")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_cider"]
    os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(train_loader, disable=rank != 0, desc=f"epoch {epoch}")
        for pixel_values, labels in pbar:
            pixel_values, labels = pixel_values.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=pixel_values, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0:
                pbar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")

        cider, bleu4 = evaluate(model, val_loader, tokenizer, args, device, rank)
        if rank == 0:
            print(f"epoch {epoch}: CIDEr {cider:.4f} BLEU-4 {bleu4:.4f}")
        is_best = cider > best
        best = max(best, cider)
        save_checkpoint(model, optimizer, scheduler, epoch, best, args.save_dir, is_best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
