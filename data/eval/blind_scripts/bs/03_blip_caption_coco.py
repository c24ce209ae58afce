"""BLIP captioning fine-tune on COCO Karpathy split, CIDEr-based model selection.

    torchrun --standalone --nproc_per_node=4 03_blip_caption_coco.py \
        --coco-root /datasets/coco --ann-dir /datasets/coco/karpathy --out ckpt/blip_cap
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BlipForConditionalGeneration, BlipProcessor, get_linear_schedule_with_warmup

logger = logging.getLogger("blip_cap")


class CocoCaptionTrain(Dataset):
    def __init__(self, ann_file, coco_root, prompt="a picture of "):
        with open(ann_file) as f:
            self.anns = json.load(f)
        self.root = coco_root
        self.prompt = prompt

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        img = Image.open(os.path.join(self.root, a["image"])).convert("RGB")
        return img, self.prompt + a["caption"].strip().lower()


class CocoCaptionEval(Dataset):
    """One item per image; references kept separately, keyed by image id."""

    def __init__(self, ann_file, coco_root):
        with open(ann_file) as f:
            anns = json.load(f)
        self.items = [(a["image"], int(a["image"].split("_")[-1].split(".")[0])) for a in anns]
        self.refs = {img_id: a["caption"] for a, (_, img_id) in zip(anns, self.items)}
        self.root = coco_root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, img_id = self.items[i]
        return Image.open(os.path.join(self.root, path)).convert("RGB"), img_id


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-root", required=True)
    ap.add_argument("--ann-dir", required=True)
    ap.add_argument("--out", default="ckpt/blip_cap")
    ap.add_argument("--model", default="Salesforce/blip-image-captioning-base")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--num-beams", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=30)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def score_captions(preds, refs):
    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
    res = tok.tokenize({k: [{"caption": preds[k]}] for k in preds})
    cider, _ = Cider().compute_score(gts, res)
    bleu, _ = Bleu(4).compute_score(gts, res)
    return {"CIDEr": cider, "BLEU-4": bleu[3]}


@torch.no_grad()
def generate_captions(model, processor, loader, args, device):
    model.eval()
    preds = {}
    for images, img_ids in loader:
        inputs = processor(images=list(images), text=["a picture of "] * len(images),
                           return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.module.generate(**inputs, num_beams=args.num_beams,
                                        max_length=args.max_len, min_length=5, repetition_penalty=1.0)
        caps = processor.batch_decode(out, skip_special_tokens=True)
        for img_id, c in zip(img_ids.tolist(), caps):
            preds[img_id] = c.replace("a picture of", "", 1).strip()
    model.train()
    return preds


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    processor = BlipProcessor.from_pretrained(args.model)
    model = BlipForConditionalGeneration.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    def train_collate(batch):
        imgs, caps = zip(*batch)
        enc = processor(images=list(imgs), text=list(caps), padding="longest", truncation=True,
                        max_length=40, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        enc["labels"] = labels
        return enc

    def eval_collate(batch):
        imgs, ids = zip(*batch)
        return list(imgs), torch.tensor(ids)

    train_ds = CocoCaptionTrain(os.path.join(args.ann_dir, "coco_karpathy_train.json"), args.coco_root)
    val_ds = CocoCaptionEval(os.path.join(args.ann_dir, "coco_karpathy_val.json"), args.coco_root)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              collate_fn=train_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=32, sampler=val_sampler, num_workers=4,
                            collate_fn=eval_collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_cider = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_loader):
            batch = batch.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                logger.info("epoch %d it %d/%d loss %.4f lr %.2e", epoch, it, len(train_loader),
                            l.item() / world_size, scheduler.get_last_lr()[0])

        preds = generate_captions(model, processor, val_loader, args, device)
        scores = score_captions(preds, val_ds.refs)
        logger.info("epoch %d val: CIDEr %.4f BLEU-4 %.4f", epoch, scores["CIDEr"], scores["BLEU-4"])

        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, "last"))
            if scores["CIDEr"] > best_cider:
                best_cider = scores["CIDEr"]
                model.module.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best_val_preds.json"), "w") as f:
                    json.dump([{"image_id": k, "caption": v} for k, v in preds.items()], f)
        dist.barrier()

    logger.info("best CIDEr %.4f", best_cider)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
