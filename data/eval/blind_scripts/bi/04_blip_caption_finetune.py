"""Fine-tune BLIP (base) for image captioning on COCO Karpathy train, evaluate CIDEr on val.

Annotation files are the Karpathy-split JSONs used by the BLIP repo:
[{"image": "val2014/COCO_val2014_000000391895.jpg", "caption": "...", "image_id": ...}, ...]
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import wandb
import yaml
from PIL import Image
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BlipForConditionalGeneration, BlipProcessor

DEFAULT_CFG = {
    "pretrained": "Salesforce/blip-image-captioning-base",
    "image_root": "/data/coco/images",
    "train_ann": "/data/coco/annotations/coco_karpathy_train.json",
    "val_ann": "/data/coco/annotations/coco_karpathy_val.json",
    "prompt": "a picture of ",
    "batch_size": 32,
    "lr": 1e-5,
    "weight_decay": 0.05,
    "epochs": 5,
    "max_length": 40,
    "num_beams": 3,
    "num_workers": 6,
    "output_dir": "output/blip_caption_coco",
    "wandb_project": "blip-caption",
}


class CocoCaption(Dataset):
    def __init__(self, ann_file, image_root):
        with open(ann_file) as f:
            anns = json.load(f)
        # train json: one entry per caption; val json: one entry per image with a list of captions
        self.items = [(a["image"], a["caption"]) for a in anns]
        self.image_root = image_root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, cap = self.items[idx]
        image = Image.open(os.path.join(self.image_root, path)).convert("RGB")
        return image, cap, idx


class Collator:
    def __init__(self, processor, prompt, max_length):
        self.processor = processor
        self.prompt = prompt
        self.max_length = max_length

    def __call__(self, batch):
        images, caps, idx = zip(*batch)
        texts = [self.prompt + c.strip().lower() if isinstance(c, str) else "" for c in caps]
        enc = self.processor(images=list(images), text=texts, padding="longest", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        enc["labels"] = labels
        enc["idx"] = torch.tensor(idx)
        return enc


def cider_score(preds, gts):
    tok = PTBTokenizer()
    res = tok.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    ref = tok.tokenize({k: [{"caption": c} for c in v] for k, v in gts.items()})
    score, _ = Cider().compute_score(ref, res)
    return score


@torch.no_grad()
def generate_val(model, processor, loader, device, cfg):
    model.eval()
    out = {}
    prompt_ids = processor.tokenizer(cfg["prompt"], add_special_tokens=True, return_tensors="pt").input_ids
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        input_ids = prompt_ids.repeat(pixel_values.shape[0], 1).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            gen = model.generate(pixel_values=pixel_values, input_ids=input_ids,
                                 num_beams=cfg["num_beams"], max_length=cfg["max_length"], min_length=5)
        texts = processor.batch_decode(gen, skip_special_tokens=True)
        for i, t in zip(batch["idx"].tolist(), texts):
            out[i] = t[len(cfg["prompt"]):].strip() if t.startswith(cfg["prompt"]) else t.strip()
    model.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--run-name", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=cfg["wandb_project"], name=args.run_name, config=cfg)

    processor = BlipProcessor.from_pretrained(cfg["pretrained"])
    model = BlipForConditionalGeneration.from_pretrained(cfg["pretrained"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = CocoCaption(cfg["train_ann"], cfg["image_root"])
    val_set = CocoCaption(cfg["val_ann"], cfg["image_root"])
    collate = Collator(processor, cfg["prompt"], cfg["max_length"])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], collate_fn=collate, pin_memory=True,
                              drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler,
                            num_workers=cfg["num_workers"], collate_fn=collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)
    best_cider = -1.0
    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            attention_mask = batch["attention_mask"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(pixel_values=pixel_values, input_ids=input_ids,
                            attention_mask=attention_mask, labels=labels)
                loss = out.loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        # caption the val images on every rank, gather the predictions on rank 0
        local_preds = generate_val(model.module, processor, val_loader, device, cfg)
        all_preds = [None] * world if rank == 0 else None
        dist.gather_object(local_preds, all_preds, dst=0)
        if rank == 0:
            preds = {}
            for p in all_preds:
                preds.update(p)
            gts = {i: val_set.items[i][1] for i in preds}
            cider = cider_score(preds, gts)
            print(f"epoch {epoch} CIDEr {cider:.4f}", flush=True)
            wandb.log({"val/cider": cider, "epoch": epoch}, step=step)
            if cider > best_cider:
                best_cider = cider
                model.module.save_pretrained(os.path.join(cfg["output_dir"], "best"))
                processor.save_pretrained(os.path.join(cfg["output_dir"], "best"))
            with open(os.path.join(cfg["output_dir"], f"preds_epoch{epoch}.json"), "w") as f:
                json.dump(preds, f)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
